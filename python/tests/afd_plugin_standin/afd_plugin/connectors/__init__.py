from afd_plugin.connectors.base import AFDConnectorBase, AFDControlPlane, ConnectorExtraInfo
from afd_plugin.connectors.factory import AFDConnectorFactory
from afd_plugin.connectors.metadata import (AFDA2FTransferPayload, AFDControlPayload, AFDDPMetadata,
                                            AFDExpertRoutingSpec, AFDTransferContext,
                                            AFDTransferMetadata, AFDTransferState)

__all__ = ["AFDA2FTransferPayload", "AFDConnectorBase", "AFDConnectorFactory", "AFDControlPayload",
           "AFDControlPlane", "AFDDPMetadata", "AFDExpertRoutingSpec", "AFDTransferContext",
           "AFDTransferMetadata", "AFDTransferState", "ConnectorExtraInfo"]
