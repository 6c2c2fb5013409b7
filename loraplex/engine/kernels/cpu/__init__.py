"""C kernels for serving on the CPU, built on first use with the machine's C compiler (build.py)."""
