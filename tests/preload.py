"""What the workers of every launch in this suite would import again: imported once by the
workers' forkserver (MESHSPLIT_PRELOAD, set in conftest.py), so each launch's workers start
with it. Importing transformers and the modeling code of the families the tests build costs
a worker seconds; the classes are only looked up here, nothing is built or run.
"""

import contextlib
import re
from pathlib import Path

import pytest  # noqa: F401  (every test module imports it)

try:
    import transformers
except ImportError:  # the suite skips the Hugging Face tests then
    transformers = None

_NAMED = re.compile(r"transformers\.([A-Z]\w+)|\"([A-Z]\w*(?:Config|Model|For[A-Z]\w*))\"")
"""transformers.GPT2Config, or a class named in a table: "MixtralForCausalLM"."""


def _named_classes() -> set[str]:
    names = set()
    for source in Path(__file__).parent.glob("*.py"):
        for attribute, quoted in _NAMED.findall(source.read_text()):
            names.add(attribute or quoted)
    return names


if transformers is not None:
    for name in sorted(_named_classes()):
        # not a transformers class, or one this version lacks: the test finds out itself
        with contextlib.suppress(Exception):
            getattr(transformers, name)  # imports its modeling or configuration module
