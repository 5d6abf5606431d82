"""Connectors by name, loaded lazily and checked to be AFDConnectorBase."""
import importlib

from afd_plugin.connectors.base import AFDConnectorBase


class AFDConnectorFactory:
    _registry = {}

    @classmethod
    def register_connector(cls, name, module_path, class_name, *, replace=False):
        if name in cls._registry and not replace:
            raise ValueError(f"connector {name!r} is already registered")

        def loader():
            connector_cls = vars(importlib.import_module(module_path))[class_name]
            if not issubclass(connector_cls, AFDConnectorBase):
                raise TypeError(f"{module_path}.{class_name} is not an AFDConnectorBase")
            return connector_cls

        cls._registry[name] = loader

    @classmethod
    def create_connector(cls, rank, local_rank, vllm_config, afd_config):
        if afd_config.connector not in cls._registry:
            raise ValueError(f"unsupported AFD connector type: {afd_config.connector}")
        connector_cls = cls._registry[afd_config.connector]()
        role_rank = int(vllm_config.parallel_config.data_parallel_rank)  # TP 1, PCP 1
        return connector_cls(rank, local_rank, vllm_config, afd_config, role_rank)
