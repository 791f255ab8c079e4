"""The cuda backend (``backend.py``) and its kernels, one family per file, each ``.cu`` beside its
launchers: ``matvec`` (up to 8 rows of x), ``mm`` (the tensor-core matmuls: mm.cu, mmq.cu),
``dequant``, ``gemm`` (the path per weight format and rows, the fused entry points),
``norm_rope_kv``, ``attention``, ``selection``; ``runtime`` (modules, the launcher, checks, the
device's table), ``instances`` (what production compiles), ``tuning`` (launch values),
``memory`` (the layout the arena and the planner share) and ``arena``. The kernel variants
production does not launch are in dev/cuda."""
