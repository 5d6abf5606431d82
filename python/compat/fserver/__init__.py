"""StepMesh's ``fserver`` package: ``fserver.f`` is fserver_lib (stepmesh.fserver)."""

import fserver_lib as f  # noqa: F401

from fserver_lib import *  # noqa: F401,F403
