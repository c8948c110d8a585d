"""KDA (Kimi Delta Attention) internals.

``chunk.py`` / ``decode.py``: argument checks and dispatch of ``chunk_kda`` /
``gated_delta_rule_decode`` (public in :mod:`mate_cupy.kda_interface`); ``common.py``:
shared helpers; ``chunk_kernels.py`` / ``decode_kernels.py``: the CUDA launchers.
"""
