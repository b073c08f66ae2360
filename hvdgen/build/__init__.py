"""Horovod built for the frameworks installed here: the patched sdist built into a cached wheel
(horovod_wheel, patches), the CUDA toolkit and NCCL a GPU build compiles against (cuda), and what
an installed build can do (checks)."""
