"""What the two AFD connectors (stepmesh.afd.Connector and
stepmesh.vllm.StepMeshAFDConnector) do alike when they join the mesh."""

from typing import Any


def join(connector: Any, attention: bool, options: Any) -> None:
    """Makes `connector`'s node (its _init_attention or _init_ffn) and waits in
    the joining barrier; on any failure tears the connector down (its node and
    scheduler, connector._teardown()) and raises."""
    try:
        if attention:
            connector._init_attention(options)
        else:
            connector._init_ffn(options)
        connector._node.barrier()
    except BaseException:
        connector._teardown()
        raise
