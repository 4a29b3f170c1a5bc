"""vLLM: the general plugin (plugin; its entry point:
``cached_client.integrations.vllm.plugin:register``), the daemon a vLLM process uses (state)
and the daemon-backed FP8 linear kernels (kernel)."""
