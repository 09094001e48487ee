"""Write the man page stfs(1) of this checkout to OUT as the package's build does (argparse-manpage, with
pyproject.toml's [tool.build_manpages]): ``python3 scripts/man_page.py OUT``. An editable install (``pip install
-e``, scripts/setup.sh) builds the page into build/man/ but installs it nowhere man(1) looks; scripts/setup.sh puts
what this writes in /usr/local/share/man/man1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from argparse_manpage.manpage import Manpage
from argparse_manpage.tooling import get_parser, write_to_filename
from build_manpages.build_manpages import get_pyproject_settings, parse_manpages_spec

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 scripts/man_page.py OUT", file=sys.stderr)
        return 2
    out = os.path.abspath(argv[0])
    os.chdir(ROOT)  # the spec is ./pyproject.toml's; its include= is relative to it
    sys.path.insert(0, str(ROOT))
    import stfs

    spec = get_pyproject_settings()
    assert spec is not None, "pyproject.toml has no [tool.build_manpages] manpages"
    [data] = parse_manpages_spec(spec).values()
    data.update(project_name="stfs", version=stfs.__version__)  # what the build takes from the package's metadata
    parser = get_parser(data["import_type"], data["import_from"], data["objname"], data["objtype"], data.get("prog"))
    write_to_filename(str(Manpage(parser, format=data.get("format", "pretty"), _data=data)), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
