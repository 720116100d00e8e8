"""Typed configs: one pydantic model per concern, loaded from YAML and `key.path=value` overrides.

Precedence, written once here: field defaults < the YAML file < TRAINPOD_SET < --set on the CLI.
"""

from trainpod.config.loader import Section, config_hash, dump_config, load_config, parse_overrides

__all__ = ["Section", "config_hash", "dump_config", "load_config", "parse_overrides"]
