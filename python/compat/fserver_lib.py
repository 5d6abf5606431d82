"""StepMesh's module name for its Python surface: ``import fserver_lib as f``.

This module *is* stepmesh.fserver (one process-global mesh, whichever name a
program imports it by); docs/python.md lists what differs from StepMesh.
"""

import sys

from stepmesh import fserver as _fserver

sys.modules[__name__] = _fserver
