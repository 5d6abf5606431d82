"""A stand-in for vllm-project/afd-plugin, written from the documented
connector contract (../shared/reference/frameworks.md section 3, in our words)
for tests on a machine without vLLM: the base classes, the metadata types,
the factory and the config validator's supported-names tuple. As strict as
the plugin where the tests lean on it: the factory's issubclass check,
seq_lens > 0, the names tuple read at call time. Not the plugin's code."""
