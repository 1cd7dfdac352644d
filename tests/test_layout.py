"""The layout rules of the flat modules: no module reads another's private (`_name`) attributes.

A reader follows a name from one file into the file it comes from; a private name used from
outside is an interface nobody documented.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))


def test_no_module_reads_another_modules_private_names():
    pattern = re.compile(r"\b(%s)\._[A-Za-z]\w*" % "|".join(MODULES))
    found = [f"{path.name}: {m.group(0)}" for path in sorted(ROOT.glob("*.py"))
             for m in pattern.finditer(path.read_text()) if m.group(1) != path.stem]
    assert len(MODULES) >= 8 and found == []
