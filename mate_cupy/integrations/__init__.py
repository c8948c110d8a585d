"""Framework-native ops: ``torch.library`` custom ops (``torch_ops``) and XLA FFI targets
for ``jax.jit`` (``jax_ffi``). Neither framework is imported until its module is."""
