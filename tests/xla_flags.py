"""XLA_FLAGS the tests share, in a module that imports nothing: conftest.py sets them before jax starts."""

# Less XLA optimisation, which halves compile time: the jax pass's own processes (conftest.py;
# docs/decisions.md, item 146) and the jax subprocesses whose runs are compared with each other (every
# run of a comparison gets the same flags, so it still holds).
XLA_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
