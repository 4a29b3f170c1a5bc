"""The JIT libraries' hooks, one compile per kernel per node through write-back: the
:class:`hook.Hook` base they share, artifact identity by content (content), FlashInfer's
nvcc modules (nvcc), Humming's cubins (humming), Triton's remote-cache backend (triton)."""
