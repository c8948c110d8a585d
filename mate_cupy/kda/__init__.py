"""KDA (Kimi Delta Attention) internals.

``chunk.py`` / ``decode.py``: the one validation and the configuration of ``chunk_kda`` /
``gated_delta_rule_decode`` (public in :mod:`mate_cupy.kda_interface`); ``chunk_launch.py``
/ ``decode_launch.py``: their CUDA launchers; ``common.py``: shared helpers; ``segments.py``:
the segment maps' combine (intra-sequence and context parallelism).
"""
