"""BENCHMARKS.md is whole (#58 item 6): every benchmark regenerate.py registers has its
section, as that benchmark printed it."""

from benchmarks import regenerate


def test_every_registered_benchmark_has_its_section():
  assert regenerate.missing() == []


def test_a_file_without_a_section_is_found_out(tmp_path):
  path = tmp_path / "BENCHMARKS.md"
  first = regenerate.BENCHMARKS[0].name
  path.write_text(f"# Benchmarks\n\n<!-- benchmark: {first} -->\n## x\n\nbody\n")
  assert regenerate.missing(str(path)) == [b.name for b in regenerate.BENCHMARKS[1:]]
