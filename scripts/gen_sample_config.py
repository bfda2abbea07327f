"""Rewrite packaging/elasticd.toml from the settings in elasticd.config.

Run after adding or changing a setting: python scripts/gen_sample_config.py
(tests/test_config.py fails while the sample and the code disagree).
"""
import os

from elasticd import config

PATH = os.path.join(os.path.dirname(__file__), "..", "packaging", "elasticd.toml")

with open(PATH) as fh:
    lines = fh.read().split("\n")
header = "\n".join(lines[:lines.index("[daemon]")])
with open(PATH, "w") as fh:
    fh.write(config.sample_toml(header))
