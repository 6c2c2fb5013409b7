"""Kernel tests run the Triton kernels on CPU through the interpreter.

TRITON_INTERPRET is read when a kernel is decorated (module import), so it is set here, before the
test modules import the kernels; modules imported earlier in the session without it are reloaded.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in ("loraplex.engine.kernels.sgmv", "loraplex.engine.kernels.bgmv"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
