"""cached: a per-node compilation-cache daemon for CuTe-DSL GEMM kernels.

Flow (the flat spine): socket (server.py) -> service.py -> scheduler.py -> pool.py ->
worker.py -> build.py; the parts around it in folders: store/ (what is built), fleet/ (the
tier shared between nodes), ops/ (the ops beside get), view/ (stats, metrics, the page),
families/ (the kernels), cli/ (the commands).
"""
