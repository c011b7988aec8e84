"""Check a DeepSpeed hostfile before launching: one `HOST slots=N` per line, `#` comments.

    python -m truneg.hostfile launch/hosts     # prints the nodes, or one line naming the bad line; exit 2
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from truneg.errors import UserError, exit_on_user_error

LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")


def check_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order. Stricter than DeepSpeed's parser, which accepts trailing words and
    slots=0, and names the line at fault."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"hostfile {path} does not exist; write one `HOST slots=N` line per node (see launch/hosts)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise UserError(f"{path}:{number}: {line!r} is not `HOST slots=N`; fix or comment out that line")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise UserError(f"{path}:{number}: {host} has slots={slots}; give it the number of GPUs on that node (>= 1)")
        if host in pool:
            raise UserError(f"{path}:{number}: {host} is listed twice; keep one line per node")
        pool[host] = slots
    if not pool:
        raise UserError(f"hostfile {path} lists no node; write one `HOST slots=N` line per node")
    return pool


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise UserError("usage: python -m truneg.hostfile HOSTFILE")
    pool = check_hostfile(args[0])
    print(f"{args[0]}: {len(pool)} nodes, {sum(pool.values())} slots: " + ", ".join(f"{h}={s}" for h, s in pool.items()))


if __name__ == "__main__":
    main()
