"""Every error's link names a section that exists, and every local link in the docs opens."""

import pathlib
import re

import pytest

from hbm_guard._src.record import errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: pathlib.Path) -> set[str]:
  """GitHub's anchors for a markdown file's headings."""
  out = set()
  for line in path.read_text(encoding="utf-8").splitlines():
    m = re.match(r"#+\s+(.*)", line)
    if m:
      text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
      out.add(text.replace(" ", "-"))
  return out


def _error_classes():
  return sorted((c for c in vars(errors).values() if isinstance(c, type)
                 and issubclass(c, errors.HbmGuardError) and not c.__name__.startswith("_")),
                key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_each_error_links_to_its_own_section(cls):
  message = str(cls("x"))
  doc, _, anchor = re.search(r"\((https://\S+)\)$", message).group(1).partition("#")
  path = ROOT / doc.split("/blob/main/", 1)[1]
  assert path.is_file(), path
  assert anchor == cls.__name__.lower()
  assert anchor in _anchors(path), f"{anchor} is not a heading of {path.name}"


@pytest.mark.parametrize("page", ["README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_local_links_in_the_docs_open(page):
  path = ROOT / page
  for target in _LINK.findall(path.read_text(encoding="utf-8")):
    if "://" in target or target.startswith("mailto:"):
      continue
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    assert dest.exists(), f"{page}: {target}"
    if anchor and dest.suffix == ".md":
      assert anchor in _anchors(dest), f"{page}: {target}"
