"""`fusefs run -- COMMAND`: unmodified training scripts (a plain one under Debian's python3,
torchrun with DistributedSampler, Lightning's DDP, Accelerate, torchdata's StatefulDataLoader
resumed mid-epoch) hand the mount each epoch's order before its first read, and yield exactly
what they yield without the launcher."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from fusefs import launch
from fusefs.pack import pack
from testkit.mounts import running_mount
from trainer.hints import mount_ids

from conftest import REPO, as_attacker

VENV_PY = sys.executable
DEBIAN_PY = "/usr/bin/python3"
FUSEFS = os.path.join(os.path.dirname(sys.executable), "fusefs")
CLASSES, PER_CLASS = 3, 40

# What every script below imports: the epoch of the order in force when each sample was read
# (read by the loader's worker, at the read), and the order in force after an epoch.
PROBE = '''
import os, struct

def in_force(mnt, rank):
    """(epoch, ids) of the order in force for rank; (-1, []) for none."""
    try:
        with open(os.path.join(mnt, ".fusefs", "order.%d" % rank), "rb") as f:
            data = f.read()
    except FileNotFoundError:  # (not a mount)
        return -1, []
    if not data:
        return -1, []
    epoch, n = struct.unpack_from("<qq", data, 16)
    return epoch, list(struct.unpack_from("<%dI" % n, data, 32))

def rank():
    return int(os.environ.get("LOCAL_RANK", "0"))

class Reader:
    """A loader of samples: (path, the epoch of the order in force as it is read)."""
    def __init__(self, mnt):
        self.mnt = mnt
    def __call__(self, path):
        with open(path, "rb") as f:
            f.read()
        return path, in_force(self.mnt, rank())[0]

try:
    from torch.utils.data import Dataset
except ImportError:
    Dataset = object

class Folder(Dataset):
    """An ImageFolder without torchvision: .samples, as ImageFolder has them."""
    def __init__(self, root):
        self.samples = [(os.path.join(root, c, f), k) for k, c in enumerate(sorted(os.listdir(root)))
                        for f in sorted(os.listdir(os.path.join(root, c)))]
        self.loader = Reader(root)
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        path, target = self.samples[i]
        return self.loader(path), target

class Record:
    """Per epoch: the paths yielded, the order epoch in force at each read, and the order in
    force after the epoch."""
    def __init__(self):
        self.epochs = []
    def begin(self):
        self.epochs.append({"paths": [], "in_force": []})
    def add(self, batch):
        (paths, epochs), _ = batch
        self.epochs[-1]["paths"] += list(paths)
        self.epochs[-1]["in_force"] += [int(e) for e in epochs]
    def end(self, mnt):
        self.epochs[-1]["after"] = in_force(mnt, rank())
    def dump(self, out):
        import json
        with open(out, "w") as f:
            json.dump(self.epochs, f)
'''

PLAIN = '''
import sys, torch
from torchvision.datasets import ImageFolder
from torch.utils.data import DataLoader
from probe import Reader, Record
mnt, out = sys.argv[1:3]
torch.manual_seed(0)
loader = DataLoader(ImageFolder(mnt, loader=Reader(mnt)), batch_size=8, shuffle=True, num_workers=2)
rec = Record()
for epoch in range(2):
    rec.begin()
    for batch in loader:
        rec.add(batch)
    rec.end(mnt)
rec.dump(out)
'''

TORCHRUN = '''
import sys, torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from probe import Folder, Record, rank
mnt, out = sys.argv[1:3]
dist.init_process_group("gloo")
ds = Folder(mnt)
sampler = DistributedSampler(ds, shuffle=True, seed=5)
loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=1, persistent_workers=True)
rec = Record()
for epoch in range(2):
    sampler.set_epoch(epoch)
    rec.begin()
    for batch in loader:
        rec.add(batch)
    rec.end(mnt)
rec.dump(out % rank())
dist.destroy_process_group()
'''

LIGHTNING = '''
import sys, torch
import lightning as L
from torch.utils.data import DataLoader
from probe import Folder, Record
mnt, out = sys.argv[1:3]

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.rec = Record()
    def on_train_epoch_start(self):
        self.rec.begin()
    def training_step(self, batch, i):
        self.rec.add(batch)
        return (self.w ** 2).sum()
    def on_train_epoch_end(self):
        self.rec.end(mnt)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return DataLoader(Folder(mnt), batch_size=8, shuffle=True, num_workers=1)

model = Model()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
trainer.fit(model)
model.rec.dump(out % trainer.global_rank)
'''

ACCELERATE = '''
import sys, torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from probe import Folder, Record
mnt, out = sys.argv[1:3]
torch.manual_seed(0)  # (accelerate's sampler seeds itself from torch's seed)
acc = Accelerator(cpu=True)
loader = acc.prepare(DataLoader(Folder(mnt), batch_size=8, shuffle=True, num_workers=1))
rec = Record()
for epoch in range(2):
    loader.set_epoch(epoch)
    rec.begin()
    for batch in loader:
        rec.add(batch)
    rec.end(mnt)
rec.dump(out % acc.process_index)
'''

STATEFUL = '''
import sys, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from probe import Folder, Record
mnt, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
ds = Folder(mnt)
rec = Record()
loader = StatefulDataLoader(ds, batch_size=8, shuffle=True, num_workers=workers)
rec.begin()
it = iter(loader)
for _ in range(5):
    rec.add(next(it))
state = loader.state_dict()
rec.end(mnt)
del it, loader
resumed = StatefulDataLoader(ds, batch_size=8, shuffle=True, num_workers=workers)
resumed.load_state_dict(state)
rec.begin()
for batch in resumed:
    rec.add(batch)
rec.end(mnt)
rec.dump(out)
'''


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """An ImageFolder of 3 classes x 40 small files, packed."""
    base = tmp_path_factory.mktemp("run")
    rng = random.Random(7)
    for c in range(CLASSES):
        os.makedirs(base / "src" / f"class{c}")
        for i in range(PER_CLASS):
            (base / "src" / f"class{c}" / f"img{i:03d}.jpg").write_bytes(rng.randbytes(rng.randrange(200, 4000)))
    pack(str(base / "src"), str(base / "dst"), chunk_bytes=64 << 10, progress=False)
    return str(base / "src"), str(base / "dst")


@pytest.fixture
def mnt(packed, tmp_path):
    """A fresh mount of the packed set (no order in force yet), and a folder for scripts."""
    mnt = tmp_path / "mnt"
    with running_mount(packed[1], mnt, "--cache-size", "1MiB"):
        yield str(mnt)


def script(tmp_path, text: str) -> str:
    (tmp_path / "probe.py").write_text(PROBE)
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def run(cmd: list[str], hinted: bool, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """cmd, under `fusefs run` if hinted; it must exit 0. Its temporary files go in cwd/tmp
    (TMPDIR): a DataLoader's persistent workers, terminated at the script's exit, leave
    multiprocessing's pymp-* folders behind, which must not stay in /tmp."""
    full = [FUSEFS, "run", "--", *cmd] if hinted else cmd
    tmp = os.path.join(cwd, "tmp")
    os.makedirs(tmp, exist_ok=True)
    r = subprocess.run(full, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                       env=dict(os.environ, TMPDIR=tmp))
    assert r.returncode == 0, f"{' '.join(full)}:\n{r.stderr[-4000:]}"
    return r


def records(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def check_hinted(mnt: str, epochs: list[dict], first_epoch: int = 0) -> None:
    """Each epoch's samples were all read under that epoch's order, and the order in force
    after the epoch is exactly the epoch's samples, in the order the loader yielded them."""
    table = mount_ids(mnt)
    for k, e in enumerate(epochs, first_epoch):
        assert e["paths"], "an epoch yielded nothing"
        assert set(e["in_force"]) == {k}, f"epoch {k}: read under orders of epochs {set(e['in_force'])}"
        ids = [table[os.fsencode(os.path.relpath(p, mnt))] for p in e["paths"]]
        assert e["after"] == [k, ids]


def same_yields(a: list[dict], b: list[dict]) -> None:
    assert [e["paths"] for e in a] == [e["paths"] for e in b]


def test_an_unmodified_script_under_debians_python_yields_the_same_and_hints_each_epoch(mnt, tmp_path):
    py = script(tmp_path, PLAIN)
    run([DEBIAN_PY, py, mnt, str(tmp_path / "plain.json")], hinted=False, cwd=tmp_path)
    r = run([DEBIAN_PY, py, mnt, str(tmp_path / "hinted.json")], hinted=True, cwd=tmp_path)
    plain, hinted = records(tmp_path / "plain.json"), records(tmp_path / "hinted.json")
    same_yields(plain, hinted)  # (the global RNG's seed draw included: same point, same stream)
    assert sorted(hinted[0]["paths"]) == sorted(hinted[1]["paths"]) != hinted[0]["paths"]
    check_hinted(mnt, hinted)
    assert r.stderr.count("fusefs run: hinting DataLoaders over ImageFolder (120 files") == 1, r.stderr


def torchrun(py: str, *args) -> list[str]:
    return [VENV_PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), py, *args]


def _free_port() -> int:
    from conftest import free_port
    return free_port()


def test_torchrun_with_distributed_sampler_hints_each_rank_with_its_share(mnt, tmp_path):
    from torch.utils.data import DistributedSampler
    py = script(tmp_path, TORCHRUN)
    run(torchrun(py, mnt, str(tmp_path / "hinted.%d.json")), hinted=True, cwd=tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        from probe import Folder
        ds = Folder(mnt)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("probe", None)
    for rank in range(2):
        got = records(tmp_path / f"hinted.{rank}.json")
        check_hinted(mnt, got)
        for epoch in range(2):  # (exactly DistributedSampler's share: seed, epoch, rank, padding)
            theirs = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
            theirs.set_epoch(epoch)
            assert got[epoch]["paths"] == [ds.samples[i][0] for i in theirs]


def test_lightning_ddp_replacing_the_sampler_is_hinted_per_rank(mnt, tmp_path):
    py = script(tmp_path, LIGHTNING)
    run([VENV_PY, py, mnt, str(tmp_path / "plain.%d.json")], hinted=False, cwd=tmp_path)
    run([VENV_PY, py, mnt, str(tmp_path / "hinted.%d.json")], hinted=True, cwd=tmp_path)
    seen = []
    for rank in range(2):
        hinted = records(tmp_path / f"hinted.{rank}.json")
        same_yields(records(tmp_path / f"plain.{rank}.json"), hinted)
        check_hinted(mnt, hinted)
        seen += hinted[0]["paths"]
    assert len(set(seen)) == CLASSES * PER_CLASS  # (each rank its DistributedSampler share)


def test_accelerate_under_torchrun_is_hinted_per_rank(mnt, tmp_path):
    py = script(tmp_path, ACCELERATE)
    run(torchrun(py, mnt, str(tmp_path / "plain.%d.json")), hinted=False, cwd=tmp_path)
    run(torchrun(py, mnt, str(tmp_path / "hinted.%d.json")), hinted=True, cwd=tmp_path)
    for rank in range(2):
        hinted = records(tmp_path / f"hinted.{rank}.json")
        same_yields(records(tmp_path / f"plain.{rank}.json"), hinted)
        check_hinted(mnt, hinted)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumed_mid_epoch_hands_the_mount_the_rest(mnt, tmp_path, workers):
    py = script(tmp_path, STATEFUL)
    run([VENV_PY, py, mnt, str(tmp_path / "plain.json"), str(workers)], hinted=False, cwd=tmp_path)
    run([VENV_PY, py, mnt, str(tmp_path / "hinted.json"), str(workers)], hinted=True, cwd=tmp_path)
    plain, hinted = records(tmp_path / "plain.json"), records(tmp_path / "hinted.json")
    same_yields(plain, hinted)
    before, rest = hinted
    assert len(before["paths"]) == 40 and len(rest["paths"]) == CLASSES * PER_CLASS - 40
    assert sorted(before["paths"] + rest["paths"]) == sorted({*before["paths"], *rest["paths"]})
    # the first loader's order was the whole epoch; the resumed one's is the rest, no more
    table = mount_ids(mnt)
    assert len(before["after"][1]) == CLASSES * PER_CLASS
    assert set(rest["in_force"]) == {1}
    assert rest["after"] == [1, [table[os.fsencode(os.path.relpath(p, mnt))] for p in rest["paths"]]]


BETWEEN_STEPS = '''
import sys, json, torch
from torch.utils.data import DataLoader, Subset
from probe import Folder, in_force
mnt, other = sys.argv[1:3]
torch.manual_seed(0)
ds = Folder(mnt)
sanity = iter(DataLoader(Subset(ds, range(0, 120, 3)), batch_size=4))
next(sanity)  # (a loader left unfinished, still held, as a sanity check before training)
train = DataLoader(ds, batch_size=8, shuffle=True)
check = DataLoader(Subset(Folder(other), range(0, 120, 10)), batch_size=4)
seen, during, after = [], None, None
for step, ((paths, _), _) in enumerate(train):
    seen += paths
    if step == 4:  # (a validation between two steps)
        during = [list(p) for (p, _), _ in check]
        after = in_force(mnt, 0)
print(json.dumps({"seen": seen, "during": during, "after": after, "end": in_force(mnt, 0)}))
'''


def test_a_loader_run_between_an_epochs_steps_gives_the_mount_back_the_epochs_rest(mnt, packed, tmp_path):
    py = script(tmp_path, BETWEEN_STEPS)
    plain = run([VENV_PY, py, mnt, mnt], hinted=False, cwd=tmp_path)
    got = json.loads(run([VENV_PY, py, mnt, mnt], hinted=True, cwd=tmp_path).stdout)
    assert got["seen"] == json.loads(plain.stdout)["seen"]
    table = mount_ids(mnt)
    ids = [table[os.fsencode(os.path.relpath(p, mnt))] for p in got["seen"]]
    checked = [table[os.fsencode(os.path.relpath(p, mnt))] for batch in got["during"] for p in batch]
    assert len(checked) == 12 and got["after"] == [0, checked]  # (the validation's, while it ran)
    # the epoch went on: its rest told again (the five batches handed out before: not again),
    # and not the rest of the loader left unfinished before it
    assert got["end"] == [0, ids[40:]]
    # a loader over another mount interrupts nothing here: this mount's order stays whole
    with running_mount(packed[1], tmp_path / "other", "--cache-size", "1MiB"):
        got = json.loads(run([VENV_PY, py, mnt, str(tmp_path / "other")], hinted=True, cwd=tmp_path).stdout)
    ids = [table[os.fsencode(os.path.relpath(p, mnt))] for p in got["seen"]]
    assert got["after"] == got["end"] == [0, ids]


ZIPPED = '''
import json, os, sys, torch
from torch.utils.data import DataLoader
from probe import Folder
mnt = sys.argv[1]
stats = lambda: json.load(open(os.path.join(mnt, ".fusefs", "stats")))["orders_accepted"]
torch.manual_seed(0)
before = stats()
a = DataLoader(Folder(mnt), batch_size=8, shuffle=True)
b = DataLoader(Folder(mnt), batch_size=8, shuffle=True)
steps = sum(1 for _ in zip(a, b))
print(json.dumps({"steps": steps, "orders": stats() - before}))
'''


def test_two_loaders_read_in_turn_tell_the_mount_an_order_per_epoch_not_per_step(mnt, tmp_path):
    py = script(tmp_path, ZIPPED)
    got = json.loads(run([VENV_PY, py, mnt], hinted=True, cwd=tmp_path).stdout)
    assert got == {"steps": 15, "orders": 2}


ODD_LOADERS = '''
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from probe import Folder
mnt, elsewhere, boom = sys.argv[1], sys.argv[2], sys.argv[3] == "boom"
if boom:  # (the hinting's own call fails: the script must not notice)
    import fusefs.client
    def refuse(*a, **k):
        raise RuntimeError("the mount is on fire")
    fusefs.client.write_order = refuse
torch.manual_seed(0)
out = []
for ds in (TensorDataset(torch.arange(50)), TensorDataset(torch.arange(9)), Folder(elsewhere), Folder(mnt)):
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=1)
    for epoch in range(2):
        out.append([x[0].tolist() if isinstance(x[0], torch.Tensor) else list(x[0][0]) for x in loader])
print(repr(out))
'''


@pytest.mark.parametrize("boom", [False, True])
def test_loaders_that_cannot_be_hinted_say_why_once_and_yield_the_same(mnt, packed, tmp_path, boom):
    py = script(tmp_path, ODD_LOADERS)
    args = [VENV_PY, py, mnt, packed[0], "boom" if boom else "-"]
    plain = run(args, hinted=False, cwd=tmp_path)
    hinted = run(args, hinted=True, cwd=tmp_path)
    assert hinted.stdout == plain.stdout
    lines = [line for line in hinted.stderr.splitlines() if line.startswith("fusefs run:")]
    said = [line for line in lines if "hinting DataLoaders" not in line]
    assert len([line for line in said if "TensorDataset" in line]) == 1, lines  # (two loaders, four epochs)
    assert not [line for line in lines if packed[0] in line]  # (a folder off the mount: nothing said)
    if boom:
        assert len([line for line in said if "RuntimeError: the mount is on fire" in line]) == 1, lines
        assert len(said) == 2
    else:
        assert len(said) == 1


def test_a_user_without_the_mounts_control_rights_is_told_why_once(shared_mount, attacker, tmp_path):
    mnt, _, files = shared_mount
    code = textwrap.dedent('''
        import os, sys, torch
        from torch.utils.data import DataLoader
        mnt = sys.argv[1]
        paths = sorted(os.path.join(mnt, p) for p in sys.argv[2:])
        for _ in range(2):
            loader = DataLoader(paths, batch_size=4, shuffle=True)
            for epoch in range(2):
                n = sum(len(b) for b in loader)
        print(n)
    ''')
    names = [k for k, v in files.items() if v is not None][:20]
    p = as_attacker(attacker, code, mnt, *names, env=launch.environment(os.environ))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert out.strip() == str(len(names))
    lines = [line for line in err.splitlines() if line.startswith("fusefs run:")]
    assert len(lines) == 1 and "cannot read its sample ids (Permission denied)" in lines[0], err


def test_the_launcher_adds_two_variables_and_runs_the_sitecustomize_it_stands_before(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import sys\nprint('their sitecustomize ran', file=sys.stderr)\n")
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(theirs)}
    env = launch.environment(base)
    assert set(env) - set(base) == {launch.HOME_ENV} and env["PATH"] == base["PATH"]
    assert env[launch.HOME_ENV] == REPO  # (the folder that holds this fusefs package)
    assert env["PYTHONPATH"].split(os.pathsep) == [launch.BOOT, str(theirs)]
    assert os.listdir(launch.BOOT) in (["sitecustomize.py"], ["sitecustomize.py", "__pycache__"],
                                       ["__pycache__", "sitecustomize.py"])
    r = subprocess.run([FUSEFS, "run", "--", DEBIAN_PY, "-c", "import fusefs.autohint, sys; "
                        "print(fusefs.autohint.__file__)"], capture_output=True, text=True,
                       env=base, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "their sitecustomize ran" in r.stderr
    assert r.stdout.strip() == os.path.join(REPO, "fusefs", "autohint.py")  # (Debian's python: ours)


def test_run_without_a_command_or_with_an_unknown_one_says_so():
    for args, why in (([], "no command given"), (["--", "no-such-command-here"], "no such command")):
        r = subprocess.run([FUSEFS, "run", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_what_the_hinting_keeps_of_a_dataset_goes_with_it(tmp_path):
    """A script that makes a dataset per epoch leaves nothing behind it in the hinting."""
    import gc
    from fusefs import autohint

    class Files:
        def __init__(self, n):
            self.samples = [(str(tmp_path / f"{i}.jpg"), 0) for i in range(n)]

        def __len__(self):
            return len(self.samples)

    before = len(autohint._targets)
    kept = Files(3)
    for n in range(50):
        assert autohint._target(Files(n + 1)) is None  # (not on a mount)
        assert autohint._target(kept) is None
    gc.collect()
    assert len(autohint._targets) == before + 1
    del kept
    gc.collect()
    assert len(autohint._targets) == before
