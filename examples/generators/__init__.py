"""Example data generators for `generator: generators.<module>:<function>` with `python_path: [examples]`."""
