"""`moelab lab new` of a title a record already has, `lab attach` of a folder that does not
exist or is attached already, a lab folder that is a file, a criterion comparing an arm with
itself: each says what it found and what was probably meant."""

from __future__ import annotations

import pytest

from moelab.lab import records as rec_mod
from test_cli import run_main
from test_lab import _write_run

NEW = ["lab", "new", "--hypothesis", "h", "--goal", "g", "--criterion", "train/loss <= 3"]


def test_a_second_record_of_one_title_is_created_with_a_warning_naming_the_first(tmp_path,
                                                                                 capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    rc, out, err = run_main([*NEW, "Bigger batch", *lab], capsys)
    assert rc == 0 and "warning" not in out + err
    for title, ids in (("Bigger batch", "0001-bigger-batch has"),
                       ("bigger batch!", "0001-bigger-batch, 0002-bigger-batch have")):
        rc, out, _ = run_main([*NEW, title, *lab], capsys)
        assert rc == 0 and f"warning: {ids} the same name, bigger-batch" in out, out
        assert "delete" in out and "attach runs to 0001-bigger-batch" in out
    assert [p.stem for p in rec_mod.record_files(tmp_path / "lab")] == [
        "0001-bigger-batch", "0002-bigger-batch", "0003-bigger-batch"]  # kept: a repeat is allowed
    rc, out, _ = run_main([*NEW, "Bigger batch again", *lab], capsys)
    assert rc == 0 and "warning" not in out  # another slug: no namesake


def test_attaching_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    assert run_main([*NEW, "t", *lab], capsys)[0] == 0
    rc, _, err = run_main(["lab", "attach", "1", str(tmp_path / "nosuch"), *lab], capsys)
    assert rc == 2 and "not a run folder" not in err, err
    assert (f"{tmp_path / 'nosuch'}: no such folder; give a run folder `moelab train` wrote, or "
            "to attach a run before it starts, train it with `moelab train CONFIG --record 1 "
            "--arm NAME`") in err


def test_attaching_a_run_already_attached_says_nothing_changed(tmp_path, capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    assert run_main([*NEW, "t", *lab], capsys)[0] == 0
    run = _write_run(tmp_path / "runs" / "a", arm_shift=0.0)
    rc, out, _ = run_main(["lab", "attach", "1", str(run), *lab], capsys)
    assert rc == 0 and f"run {run} is attached to 0001-t as arm 'a'" in out, out
    record = next((tmp_path / "lab").glob("0001-*.md"))
    before = record.read_text()
    rc, out, _ = run_main(["lab", "attach", "1", str(run), *lab], capsys)
    attached = rec_mod.load(record).runs[0].attached
    assert rc == 0 and out.strip() == (f"run {run} was already attached to 0001-t as arm 'a' "
                                       f"(since {attached}); nothing changed"), out
    assert record.read_text() == before


@pytest.mark.parametrize("where", ["--lab-dir", "MOELAB_LAB_DIR"])
@pytest.mark.parametrize("command", [[*NEW, "t"], ["lab", "list"], ["lab", "show", "1"]])
def test_a_lab_folder_that_is_a_file_is_named(tmp_path, capsys, monkeypatch, where, command):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    folder = blocker / "lab"
    if where == "--lab-dir":
        command = [*command, "--lab-dir", str(folder)]
    else:
        monkeypatch.setenv("MOELAB_LAB_DIR", str(folder))
    rc, out, err = run_main(command, capsys)
    assert rc == 2 and out == "", out  # `lab list` said "no records in ..." and exited 0
    assert err.strip() == (f"moelab: error: {where}{' ' if where[0] == '-' else '='}{folder}: "
                           f"{blocker} is a file, not a folder; give the folder of records "
                           "(new or existing)"), err


@pytest.mark.parametrize("combine", ["-", "/"])
def test_a_criterion_comparing_an_arm_with_itself_is_refused(tmp_path, capsys, combine):
    text = f"eval/prose/loss in shared {combine} shared <= 1"
    rc, _, err = run_main(["lab", "new", "t", "--hypothesis", "h", "--goal", "g", "--criterion",
                           text, "--lab-dir", str(tmp_path / "lab")], capsys)
    assert rc == 2 and (f"criterion {text!r}: compares arm 'shared' with itself, which gives "
                        f"{0 if combine == '-' else 1} whatever its runs log") in err, err
    assert not (tmp_path / "lab").exists()


def test_the_lab_refuses_urls_for_its_folders(tmp_path, capsys, monkeypatch):
    """The lab works on local folders only (README): a URL is refused naming it, never taken
    for a local path (gs://b/r became ./gs:/b/r, where `lab report --out` wrote its report)."""
    monkeypatch.chdir(tmp_path)
    lab = ["--lab-dir", "lab"]
    assert run_main([*NEW, "t", *lab], capsys)[0] == 0
    for argv, named in ((["attach", "1", "gs://b/r"], "gs://b/r"),
                        (["detach", "1", "s3://b/r", "--reason", "x"], "s3://b/r"),
                        (["report", "1", "--out", "gs://b/rep"], "--out gs://b/rep"),
                        (["live", "gs://b/r", "--port", "0"], "gs://b/r")):
        rc, _, err = run_main(["lab", *argv, *lab], capsys)
        assert rc == 2 and f"{named}: a URL; the lab reads and writes local folders" in err, err
    rc, _, err = run_main(["lab", "list", "--lab-dir", "gs://b/lab"], capsys)
    assert rc == 2 and "--lab-dir gs://b/lab: a URL" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab"]  # no ./gs:/ folder made


def test_accented_letters_keep_their_place_in_the_record_name(tmp_path, capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    rc, out, _ = run_main([*NEW, "Über-Routing à la carte", *lab], capsys)
    assert rc == 0 and "0001-uber-routing-a-la-carte.md" in out, out  # was 0001-ber-routing-la-
    rec = rec_mod.load(next((tmp_path / "lab").glob("0001-*.md")))
    assert rec.title == "Über-Routing à la carte"  # the title itself is kept as written


def test_a_folder_name_that_is_no_arm_name_asks_for_arm(tmp_path, capsys):
    lab = ["--lab-dir", str(tmp_path / "lab")]
    assert run_main([*NEW, "t", *lab], capsys)[0] == 0
    run = _write_run(tmp_path / "runs" / "my run", arm_shift=0.0)
    rc, _, err = run_main(["lab", "attach", "1", str(run), *lab], capsys)
    assert rc == 2 and "--arm 'my run'" not in err, err  # no --arm was given
    assert ("arm 'my run' (the run folder's name): use letters, digits" in err
            and "give one with --arm NAME" in err), err
    rc, _, err = run_main(["lab", "attach", "1", str(run), "--arm", "my arm", *lab], capsys)
    assert rc == 2 and "--arm 'my arm': use letters" in err and "give one" not in err, err
    assert run_main(["lab", "attach", "1", str(run), "--arm", "mine", *lab], capsys)[0] == 0
