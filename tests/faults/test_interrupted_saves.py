"""Saves interrupted at every step leave the old files or the new ones, never neither and never a mix.

A save is a sequence of steps (each file written aside, fsyncs, hard links to the old files, renames).
The tests count the steps of an undisturbed save, then rerun it with a KeyboardInterrupt or an OSError
raised at step k, for every k; a subprocess takes real SIGINTs at random moments.
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from fault_helpers import TINY, contents

from attnkit import cli
from attnkit.dates.translator import DateTranslator
from backend_utils import once_per_run

pytestmark = once_per_run  # writing, checking and refusing files: the same code whatever the backend

OUTPUTS = ["model.keras", "translator.json"]


class Faults:
    """Counts the steps of a save and raises `error` at step `at` (and every later step if `sticky`)."""

    def __init__(self, monkeypatch, translator, at=None, error=None, sticky=False):
        self.count, self.at, self.error, self.sticky = 0, at, error, sticky
        for name in ("replace", "link", "fsync"):
            monkeypatch.setattr(os, name, self.wrap(getattr(os, name)))
        monkeypatch.setattr(tempfile, "mkdtemp", self.wrap(tempfile.mkdtemp))
        writers = translator.writers()

        def wrapped_writers():
            # A fault before a file is written, and one after it is written (the file exists aside).
            return {name: self.wrap(self.wrap(write), after=True) for name, write in writers.items()}

        monkeypatch.setattr(translator, "writers", wrapped_writers)

    def wrap(self, function, after=False):
        def step(*args, **kwargs):
            if after:
                result = function(*args, **kwargs)
                self.tick()
                return result
            self.tick()
            return function(*args, **kwargs)

        return step

    def tick(self):
        self.count += 1
        if self.at is not None and (self.count == self.at or (self.sticky and self.count > self.at)):
            raise self.error


def inodes(directory):
    return {name: os.stat(directory / name).st_ino for name in OUTPUTS}


def steps_of_a_save(monkeypatch, translator, directory):
    with monkeypatch.context() as m:
        faults = Faults(m, translator)
        translator.save(directory, overwrite=True)
    return faults.count


ERRORS = [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")]


@pytest.mark.parametrize("error", ERRORS, ids=["KeyboardInterrupt", "OSError"])
def test_an_overwrite_interrupted_at_any_step_keeps_the_old_model(tiny_translator, model_copy, monkeypatch, error):
    old = inodes(model_copy)
    steps = steps_of_a_save(monkeypatch, tiny_translator, model_copy)
    assert steps >= 12  # 2 files x (before, after, fsync) + staging + links + renames + directory
    assert set(inodes(model_copy).values()).isdisjoint(old.values())  # both files were replaced
    for k in range(1, steps + 1):
        before, data = inodes(model_copy), contents(model_copy)
        with monkeypatch.context() as m:
            Faults(m, tiny_translator, at=k, error=error)
            with pytest.raises(type(error)):
                tiny_translator.save(model_copy, overwrite=True)
        assert inodes(model_copy) == before and contents(model_copy) == data, f"step {k}"
        assert sorted(os.listdir(model_copy)) == OUTPUTS, f"step {k}: leftovers"
    DateTranslator.load(model_copy)


@pytest.mark.parametrize("error", ERRORS, ids=["KeyboardInterrupt", "OSError"])
def test_a_first_save_interrupted_at_any_step_leaves_no_partial_model(tiny_translator, tmp_path, monkeypatch, error):
    steps = steps_of_a_save(monkeypatch, tiny_translator, tmp_path / "counted")
    for k in range(1, steps + 1):
        target = tmp_path / f"new{k}"
        with monkeypatch.context() as m:
            Faults(m, tiny_translator, at=k, error=error)
            with pytest.raises(type(error)):
                tiny_translator.save(target)
        assert not target.exists() or os.listdir(target) == [], f"step {k}: {os.listdir(target)}"


def test_when_restoring_fails_too_the_old_files_are_kept_and_named(tiny_translator, model_copy, monkeypatch):
    steps = steps_of_a_save(monkeypatch, tiny_translator, model_copy)
    old = contents(model_copy)
    for k in range(1, steps + 1):
        with monkeypatch.context() as m:
            Faults(m, tiny_translator, at=k, error=OSError(errno.EIO, "Input/output error"), sticky=True)
            with pytest.raises(OSError) as raised:
                tiny_translator.save(model_copy, overwrite=True)
        now = contents(model_copy)
        if "and so did restoring the previous files" not in str(raised.value):
            assert now == old, f"step {k}"
            continue
        backup = str(raised.value).rsplit("they are in ", 1)[1]
        kept = {name: open(os.path.join(backup, name), "rb").read() for name in os.listdir(backup)}
        for name in OUTPUTS:  # every old file is in its place or in the backup named
            assert old[name] in (now.get(name), kept.get(name)), f"step {k}: {name} lost"
        for name, data in kept.items():  # put the old model back for the next k
            with open(model_copy / name, "wb") as f:
                f.write(data)
        shutil.rmtree(backup)


CHILD = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys
    from attnkit.dates.translator import DateTranslator

    # SIGINT raises KeyboardInterrupt, as Python's default handler does, but only while a save (the
    # code under test) runs: a signal landing in this harness's own bookkeeping is not counted.
    armed = fired = False

    def on_sigint(signum, frame):
        global fired
        if armed:
            fired = True
            raise KeyboardInterrupt

    source, target, stop = sys.argv[1:]
    translator = DateTranslator.load(source)
    translator.save(target, overwrite=True)
    signal.signal(signal.SIGINT, on_sigint)
    saves = interrupts = checks = 0
    bad = []
    print("ready", flush=True)
    while not os.path.exists(stop):
        try:
            armed, fired = True, False
            translator.save(target, overwrite=True)
            armed = False
            saves += 1
        except (KeyboardInterrupt, Exception):
            # Code the interrupt cuts short may raise its own error in its place: on tensorflow, NumPy 2
            # re-raises a TypeError from `Variable.__array__` (about once in 250 interrupts of
            # `np.array(tf.Variable)`). Any error after the signal fired is the interrupt, and the pair
            # must be intact after it too; an error without one is a failure of the save.
            armed = False
            if not fired:
                raise
            interrupts += 1
            names = sorted(n for n in os.listdir(target) if not n.startswith(".attnkit-"))
            meta = json.load(open(os.path.join(target, "translator.json")))
            digest = hashlib.sha256(open(os.path.join(target, "model.keras"), "rb").read()).hexdigest()
            if names != ["model.keras", "translator.json"] or meta["model_sha256"] != digest:
                bad.append(names)
            checks += 1
    print(json.dumps({"saves": saves, "interrupts": interrupts, "checks": checks, "bad": bad}), flush=True)
    """
)


def test_real_sigints_at_random_moments_never_break_the_pair(saved_dir, tmp_path):
    target, stop = tmp_path / "target", tmp_path / "stop"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(saved_dir), str(target), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        rng = random.Random(0)
        for _ in range(40):
            time.sleep(rng.uniform(0.005, 0.08))
            child.send_signal(signal.SIGINT)
        stop.write_text("")
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert out.strip(), err[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["bad"] == [] and report["interrupts"] >= 20, (report, err[-2000:])
    assert sorted(n for n in os.listdir(target) if not n.startswith(".attnkit-")) == OUTPUTS
    DateTranslator.load(target)


def test_ctrl_c_during_train_force_keeps_the_previous_model(saved_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(saved_dir, out)
    old = contents(out)
    options = [o for o in TINY if o != "--quiet"] + ["--train-size", "4096", "--epochs", "50", "--batch-size", "32"]
    child = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "train", *options, "--output-dir", str(out), "--force"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        seen = ""
        while "Epoch" not in seen:  # training has begun: the destination was checked
            line = child.stdout.readline()
            assert line, child.stderr.read()[-2000:]
            seen += line
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "attnkit: interrupted" and "Traceback" not in err
    assert contents(out) == old and sorted(os.listdir(out)) == OUTPUTS


def test_cli_train_force_replaces_the_model_atomically(saved_dir, tmp_path, monkeypatch, capsys):
    """The CLI's save is the same protocol: a fault at its last rename keeps the previous pair."""
    out = tmp_path / "out"
    shutil.copytree(saved_dir, out)
    old = contents(out)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if str(dst).endswith("translator.json") and len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    assert cli.main(["train", *TINY, "--output-dir", str(out), "--force"]) == 1
    assert capsys.readouterr().err.strip().endswith(f"Input/output error: '{out}'")  # named (item 114)
    assert contents(out) == old
    assert json.loads(old["translator.json"])["model_sha256"]
