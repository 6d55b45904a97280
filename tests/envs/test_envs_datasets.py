"""Dataset files -> tasks: every file type and row format round-trips; every malformed row is an
error naming the file, the row and the field; held-out splits are disjoint and deterministic."""

import json

import pytest

from rljax.envs import Task, load_dataset_tasks, task_to_row, write_rows
from rljax.envs.datasets import read_rows

MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]


def skyrl_rows(n=6):
    return [
        {
            "data_source": "openai/gsm8k" if i % 2 else "math",
            "prompt": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
            "env_class": "gsm8k" if i % 3 else "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(n)
    ]


def verl_rows(n=5):
    return [
        {
            "data_source": "lighteval/MATH",
            "prompt": [{"role": "user", "content": f"Compute {i}/2."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": f"\\frac{{{i}}}{{2}}"},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def same_tasks(a, b):
    assert [t.id for t in a] == [t.id for t in b]
    for x, y in zip(a, b, strict=True):
        assert (x.messages, x.env, x.data_source, x.split) == (y.messages, y.env, y.data_source, y.split)
        assert dict(x.reward_spec) == dict(y.reward_spec) and dict(x.extra_info) == dict(y.extra_info)


def save_to_disk(rows, path, split=None):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "hf", "hf_dict", "hf_json"])
@pytest.mark.parametrize("fmt", ["skyrl", "verl"])
def test_every_file_type_and_row_format_reads_the_same_tasks(tmp_path, kind, fmt):
    rows = skyrl_rows() if fmt == "skyrl" else verl_rows()
    reference = tmp_path / "ref.jsonl"
    reference.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = load_dataset_tasks(reference)
    if kind in ("jsonl", "json", "parquet"):
        path = write_rows(rows, tmp_path / f"d.{kind}")
    elif kind == "hf_json":  # HF's to_json writes JSON lines into a .json file
        import datasets

        path = tmp_path / "hf.json"
        datasets.Dataset.from_list(rows).to_json(str(path))
    else:
        path = save_to_disk(rows, tmp_path / "hf", split="train" if kind == "hf_dict" else None)
    got = load_dataset_tasks(path, format=fmt)
    same_tasks(got, want)
    t = got[1]
    assert t.messages == tuple(rows[1]["prompt"]) and t.data_source == rows[1]["data_source"]
    if fmt == "skyrl":
        assert t.env == "gsm8k" and got[0].env == "gsm8k_multi_turn"  # env_class picks the env per row
        assert t.reward_spec == {"method": "rule", "ground_truth": "2"}
    else:
        assert t.env is None and t.reward_spec == {"method": "rule", "ground_truth": "\\frac{1}{2}"}
    assert t.extra_info == rows[1]["extra_info"] and t.data["prompt"] == rows[1]["prompt"]
    assert all(x.id.startswith(rows[i]["data_source"] + "-") for i, x in enumerate(got))  # content hash
    assert len({x.id for x in got}) == len(got)


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("fmt", ["skyrl", "verl"])
def test_export_load_round_trip(tmp_path, suffix, fmt):
    tasks = load_dataset_tasks(
        write_rows(skyrl_rows() if fmt == "skyrl" else verl_rows(), tmp_path / "a.jsonl")
    )
    rows = [task_to_row(t, format=fmt) for t in tasks]
    back = load_dataset_tasks(write_rows(rows, tmp_path / f"b.{suffix}"), format=fmt)
    same_tasks(back, tasks)  # same ids (the exporter writes them), messages, specs, envs
    # a task made in code round-trips too, demonstration included
    t = Task(
        "q-1",
        messages=MSG,
        env="verifiable",
        reward_spec={"method": "math_verify", "ground_truth": "42"},
        data_source="mine",
        extra_info={"k": 1},
        demonstration="6*7=42",
    )
    (u,) = load_dataset_tasks(write_rows([task_to_row(t)], tmp_path / f"c.{suffix}"))
    assert (u.id, u.messages, u.env, u.demonstration, u.extra_info) == (
        "q-1",
        t.messages,
        "verifiable",
        "6*7=42",
        {"k": 1},
    )


def test_ids_env_override_duplicates_and_splits(tmp_path):
    rows = skyrl_rows(40)
    path = write_rows(rows, tmp_path / "d.jsonl")
    a = load_dataset_tasks(path)
    assert [t.id for t in a] == [t.id for t in load_dataset_tasks(path)]  # stable
    # an id column wins; env= overrides Task.env but the row keeps its env_class
    with_ids = [{**r, "id": f"row{i}"} for i, r in enumerate(rows)]
    b = load_dataset_tasks(write_rows(with_ids, tmp_path / "e.jsonl"), env="math")
    assert [t.id for t in b] == [f"row{i}" for i in range(40)]
    assert {t.env for t in b} == {"math"} and b[0].data["env_class"] == "gsm8k_multi_turn"
    # identical rows are kept (never dropped) and get distinct stable ids
    c = load_dataset_tasks(write_rows([rows[0], rows[0], rows[1]], tmp_path / "f.jsonl"))
    assert len(c) == 3 and c[1].id == c[0].id + "~1" and len({t.id for t in c}) == 3
    # held-out fraction: disjoint, covering, deterministic, seed-dependent
    train = load_dataset_tasks(path, eval_fraction=0.25, split="train")
    test = load_dataset_tasks(path, eval_fraction=0.25, split="eval")
    assert {t.id for t in train} | {t.id for t in test} == {t.id for t in a}
    assert not {t.id for t in train} & {t.id for t in test} and 0 < len(test) < 20
    assert {t.split for t in test} == {"test"} and {t.split for t in train} == {"train"}
    assert [t.id for t in test] == [t.id for t in load_dataset_tasks(path, eval_fraction=0.25, split="test")]
    other = load_dataset_tasks(path, eval_fraction=0.25, split="test", seed=1)
    assert {t.id for t in other} != {t.id for t in test}
    # several files are read in order
    assert len(load_dataset_tasks([path, tmp_path / "e.jsonl"])) == 80


MALFORMED = [
    (lambda r: r.pop("prompt"), "prompt"),
    (lambda r: r.update(prompt=[]), "prompt"),
    (lambda r: r.update(prompt=[{"content": "x"}]), "prompt[0].role"),
    (lambda r: r.update(prompt=[{"role": "user", "content": 3}]), "prompt[0].content"),
    (lambda r: r.update(prompt=["hello"]), "prompt[0]"),
    (lambda r: r.update(reward_spec="rule"), "reward_spec"),
    (lambda r: r.update(reward_spec={"ground_truth": "1"}), "reward_spec.method"),
    (lambda r: r.update(reward_spec={"method": "rule"}), "reward_spec.ground_truth"),
    (lambda r: r.update(env_class=""), "env_class"),
    (lambda r: r.update(data_source=5), "data_source"),
    (lambda r: r.update(extra_info=[1]), "extra_info"),
    (lambda r: r.update(id=""), "id"),
    (lambda r: [r.pop("reward_spec"), r.pop("env_class")], "reward_spec"),
]


# parquet columns are typed: the cases whose bad value has another type than the column's own
# cannot be written to parquet at all, so parquet runs the others
PARQUET_CASES = [0, 1, 2, 6, 7, 8, 11]


@pytest.mark.parametrize(
    "case, suffix",
    [(c, "jsonl") for c in range(len(MALFORMED))] + [(c, "parquet") for c in PARQUET_CASES],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, case, suffix):
    mutate, field = MALFORMED[case]
    rows = skyrl_rows(5)
    mutate(rows[3])
    path = write_rows(rows, tmp_path / f"bad.{suffix}")
    where = "row 3 (line 4)" if suffix == "jsonl" else "row 3"
    with pytest.raises(ValueError) as err:
        load_dataset_tasks(path)
    msg = str(err.value)
    assert str(path) in msg and where in msg and f"field '{field}'" in msg, msg


def test_other_malformed_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(skyrl_rows(1)[0]) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1 \(line 3\): not valid JSON"):
        load_dataset_tasks(bad)
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([skyrl_rows(1)[0], 7]))
    with pytest.raises(ValueError, match=r"arr.json: row 1: field '<row>'"):
        load_dataset_tasks(arr)
    dup = write_rows([{**r, "id": "same"} for r in skyrl_rows(2)], tmp_path / "dup.jsonl")
    with pytest.raises(ValueError, match=r"dup.jsonl: row 1 \(line 2\): field 'id': duplicate id 'same'"):
        load_dataset_tasks(dup)
    verl = write_rows(verl_rows(2), tmp_path / "v.jsonl")
    with pytest.raises(ValueError, match=r"v.jsonl: row 0 \(line 1\): field 'reward_spec'"):
        load_dataset_tasks(verl, format="skyrl")
    with pytest.raises(ValueError, match=r"field 'reward_model'"):
        load_dataset_tasks(write_rows(skyrl_rows(1), tmp_path / "s.jsonl"), format="verl")
    assert len(load_dataset_tasks(verl, format="verl")) == 2
    with pytest.raises(FileNotFoundError):
        load_dataset_tasks(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown dataset file type"):
        load_dataset_tasks(write_rows_text(tmp_path / "x.csv"))
    hf = save_to_disk(skyrl_rows(2), tmp_path / "hfd", split="validation")
    assert len(load_dataset_tasks(hf, split="test")) == 2
    with pytest.raises(ValueError, match="none of them is 'train'"):
        load_dataset_tasks(hf)
    assert next(iter(read_rows(bad)))[:2] == (0, 1)


def write_rows_text(path):
    path.write_text("a,b\n")
    return path
