"""`burstengine report`: docs/results.md and the marked figures in the docs come from the records."""
import json
import shutil
from pathlib import Path

from burstengine.cli import main
from burstengine.cli import report as report_cli

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def report(*args) -> int:
    return main(["report", *map(str, args)])


def copy_tree(tmp_path):
    """The records, README and docs copied under tmp_path, as `report` would find them."""
    shutil.copytree(RECORDS, tmp_path / "records")
    docs = []
    for p in DOCS:
        dst = tmp_path / p.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
        docs.append(dst)
    return tmp_path / "records", tmp_path / "docs" / "results.md", docs


def test_committed_docs_match_the_records():
    assert report("--check", "--records", RECORDS, "--out", ROOT / "docs" / "results.md", "--docs", *DOCS) == 0


def test_report_writes_every_record(tmp_path):
    out = tmp_path / "results.md"
    assert report("--records", RECORDS, "--out", out, "--docs") == 0
    text = out.read_text()
    for rec in RECORDS.glob("*.json"):
        assert f"benchmarks/results/{rec.name}" in text, rec.name
        assert json.loads(rec.read_text())["commit"][:10] in text
    assert text == (ROOT / "docs" / "results.md").read_text()
    assert report("--check", "--records", RECORDS, "--out", out, "--docs") == 0


def test_check_fails_after_a_record_changes(tmp_path):
    records, out, docs = copy_tree(tmp_path)
    assert report("--check", "--records", records, "--out", out, "--docs", *docs) == 0
    path = records / report_cli.ATTENTION_RUN  # the record the README's headline quotes
    rec = json.loads(path.read_text())
    burst = next(r for r in rec["rows"] if r["method"] == "burst-zigzag")
    burst["fwdbwd_s"] = [t * 1.5 for t in burst["fwdbwd_s"]]
    path.write_text(json.dumps(rec))
    before = {p: p.read_text() for p in [out] + docs}
    assert report("--check", "--records", records, "--out", out, "--docs", *docs) == 1
    assert {p: p.read_text() for p in before} == before  # --check writes nothing
    # the table and the README's headline block (which quotes this ratio) both follow the record
    assert report("--records", records, "--out", out, "--docs", *docs) == 0
    readme = tmp_path / "README.md"
    assert out.read_text() != before[out] and readme.read_text() != before[readme]
    assert report("--check", "--records", records, "--out", out, "--docs", *docs) == 0


def test_an_unknown_record_is_listed_not_dropped(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    shutil.copy(RECORDS / "soak_cpu.json", records)
    (records / "attention_odd.json").write_text(json.dumps(  # a known family, a shape its table does not know
        {"command": "python odd.py", "commit": "0123456789abcdef", "env": {"device": "cpu"}, "rows": [{"x": 1}]}))
    out = tmp_path / "results.md"
    assert report("--records", records, "--out", out, "--docs") == 0
    text = out.read_text()
    assert "## Other records" in text and "`benchmarks/results/attention_odd.json`" in text and "`python odd.py`" in text
    assert "### soak_cpu" in text


def test_an_unknown_block_is_refused(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- report:nonsense -->\nx\n<!-- /report -->\n")
    assert report("--records", RECORDS, "--out", tmp_path / "r.md", "--docs", doc) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report:nonsense" in err[0] and "error:" in err[0], err


def test_both_demos_have_their_tables(tmp_path):
    """`demo_cpu` (the attention check) and `demo_finetune_cpu` (context extension) share the
    prefix demo_ but each is rendered by its own family, neither falls into "Other records"."""
    records = tmp_path / "records"
    records.mkdir()
    for name in ("demo_cpu.json", "demo_finetune_cpu.json"):
        shutil.copy(RECORDS / name, records)
    out = tmp_path / "results.md"
    assert report("--records", records, "--out", out, "--docs") == 0
    text = out.read_text()
    assert "## Other records" not in text
    demo, ft = text.index("## The demo"), text.index("## Context extension on CPU")
    assert demo < text.index("### demo_cpu\n") < ft < text.index("### demo_finetune_cpu\n")
    assert "passkey @2048" in text[ft:] and "backward scheme" in text[demo:ft]
