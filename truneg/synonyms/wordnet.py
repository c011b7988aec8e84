"""Make Princeton WordNet 3.0 readable by nltk without internet, from Debian's packages.

Debian's `wordnet-base` and `wordnet-sense-index` hold the database files. nltk (>= 3.10) reads only
real files under a root in `nltk.data.path`, and also wants `lexnames`, which no Debian package has:
its 45 rows are documented in `lexnames.5WN`, so we write it from that man page.

    python -m truneg.synonyms.wordnet [--root DIR]      # default: <sys.prefix>/share/nltk_data
"""
from __future__ import annotations

import argparse
import functools
import gzip
import re
import shutil
import sys
import warnings
from pathlib import Path

import nltk
from nltk.corpus.reader.wordnet import WordNetCorpusReader

from truneg.errors import UserError, exit_on_user_error

DEBIAN_WORDNET = Path("/usr/share/wordnet")
LEXNAMES_MAN = Path("/usr/share/man/man5/lexnames.5WN.gz")
REQUIRED_FILES = [f"{kind}.{pos}" for kind in ("index", "data") for pos in ("noun", "verb", "adj", "adv")]
INSTALL_HINT = (
    "install it with `apt-get install wordnet-base wordnet-sense-index && python -m truneg.synonyms.wordnet` "
    "(what `make setup` does), or `python -m nltk.downloader wordnet`"
)
CATEGORY_OF_PREFIX = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def default_root() -> Path:
    # sys.prefix/share/nltk_data is on nltk's default search path, so no NLTK_DATA is needed.
    return Path(sys.prefix) / "share" / "nltk_data"


def lexnames_from_man_page(man_page: Path = LEXNAMES_MAN) -> str:
    with gzip.open(man_page, "rt", encoding="utf-8") as fh:
        text = fh.read()
    rows = re.findall(r"^(\d\d)\t(\w+\.\w+)\s*\t", text, flags=re.MULTILINE)
    if len(rows) != 45:
        raise UserError(f"{man_page} lists {len(rows)} lexicographer files, expected 45; reinstall wordnet-base")
    return "".join(f"{num}\t{name}\t{CATEGORY_OF_PREFIX[name.split('.')[0]]}\n" for num, name in rows)


def install(root: Path, source: Path = DEBIAN_WORDNET) -> Path:
    """Copy the Debian WordNet files into `root/corpora/wordnet` (copies, not links: nltk refuses links)."""
    missing = [name for name in REQUIRED_FILES + ["index.sense"] if not (source / name).is_file()]
    if missing or not LEXNAMES_MAN.is_file():
        raise UserError(f"Debian WordNet files are missing ({', '.join(missing) or LEXNAMES_MAN}); {INSTALL_HINT}")
    target = root / "corpora" / "wordnet"
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            shutil.copyfile(path, target / path.name)
    (target / "lexnames").write_text(lexnames_from_man_page(), encoding="utf-8")
    return target


def _monolingual_reader_class():
    class MonolingualWordNetReader(WordNetCorpusReader):
        """nltk's reader without the WordNet-version map, which only serves the multilingual OMW data.

        nltk builds that map on every load (it compares "3.0" with "wordnet", so never skips it) by
        parsing index.sense twice: 3 of the reader's 5.5 s here, for data that synonym tables never use.
        """

        def map_wn(self, version="wordnet"):
            return None

    return MonolingualWordNetReader


@functools.lru_cache(maxsize=1)
def load_wordnet():
    """Return nltk's WordNet reader, or raise one clear UserError saying how to install WordNet."""
    if str(default_root()) not in nltk.data.path:
        nltk.data.path.append(str(default_root()))
    try:
        root = nltk.data.find("corpora/wordnet")
    except LookupError:
        raise UserError(f"WordNet is not installed for nltk; {INSTALL_HINT}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "multilingual functions are not available": we use none
            return _monolingual_reader_class()(root, None)
    except (OSError, LookupError, ValueError) as err:
        raise UserError(f"WordNet under {root} is unreadable ({err}); {INSTALL_HINT}") from None


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=default_root(), help="nltk data root to install into")
    args = parser.parse_args(argv)
    target = install(args.root)
    print(f"WordNet 3.0 installed for nltk in {target}")


if __name__ == "__main__":
    main()
