from afd_plugin.connectors.base import AFDConnectorBase, AFDControlPlane, ConnectorExtraInfo  # noqa: F401
from afd_plugin.connectors.factory import AFDConnectorFactory  # noqa: F401
from afd_plugin.connectors.metadata import *  # noqa: F401,F403
