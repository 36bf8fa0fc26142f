"""The host-kernel backends: an ipykernel on this machine, reached through a connection file.

- `local`: `LocalKernelSandbox`, a kernel under bubblewrap (`isolation`, `_drop_root`, `uids`,
  `cgroups`), or none; `warm_pool` hands out kernels started ahead of time.
- `docker`: `DockerSandbox`, a kernel in a Docker container
  (``pip install 'prefect-sandbox[docker]'``).
- `jupyter`: the connection-file transport both use; `kernel_sockets` pins the kernel's sockets,
  `workdir` copies files out of a folder the kernel may change, `host` its runtime folders.

Remote backends (`prefect_sandbox.sandbox.backends.e2b`, `.daytona`) import nothing from here.
Manual: docs/backends/local.md.
"""
