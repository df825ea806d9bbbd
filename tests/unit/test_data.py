"""The built-in arithmetic task and the prompt loader (every format, schema and error)."""

import json
import re
from collections import Counter

import pytest

from entropy_openrlhf.data import arith_task
from entropy_openrlhf.data.arith_task import generate, write_builtin_task
from entropy_openrlhf.data.dataset import DatasetError, load_prompts, validate_dataset

# ---------------------------------------------------------------------------------------------- the task


def _question(row):
    return row["prompt"][-1]["content"]


def _numbers(row):
    return [int(x) for x in re.findall(r"\d+", _question(row))]


def _answer_from_wording(row):
    """Solve the question from its words, independently of the generator."""
    q, nums = _question(row), _numbers(row)
    if len(nums) == 3:
        return nums[0] + nums[1] - nums[2]
    a, b = nums
    if re.search(r"in each|holds|every day", q):
        return a * b
    if re.search(r"gives|sold|lost", q):
        return a - b
    return a + b


def _problem_key(row):
    # level + operand multiset + answer identifies the arithmetic (see the generator's keys)
    return row["level"], tuple(sorted(_numbers(row))), int(row["label"])


def test_same_seed_same_rows_other_seed_other_rows():
    assert generate(60, seed=3) == generate(60, seed=3)
    assert generate(60, seed=3) != generate(60, seed=4)


def test_answers_match_the_wording_and_are_integers():
    rows = generate(600, seed=0, levels=(1, 2, 3, 4)) + generate(200, split="test", seed=0, levels=(1, 2, 3, 4))
    for row in rows:
        assert row["label"] == str(int(row["label"]))
        assert int(row["label"]) == _answer_from_wording(row), _question(row)
        assert int(row["label"]) >= 0


def test_train_and_test_share_no_problem_across_seeds():
    train = {_problem_key(r) for seed in (0, 1) for r in generate(3000, seed=seed, levels=(1, 2, 3, 4))}
    test = {_problem_key(r) for seed in (0, 1) for r in generate(800, split="test", seed=seed, levels=(1, 2, 3, 4))}
    assert len(test) > 100 and len(train) > 1000
    assert not train & test
    # and the worked examples are asked in neither split
    examples = {(key[0], tuple(sorted(key[2:])), answer) for *_, answer, key in arith_task.EXAMPLES}
    assert not examples & (train | test)


def test_levels_are_mixed_evenly_and_sized_as_documented():
    rows = generate(400, seed=0, levels=(1, 2, 3, 4))
    assert Counter(r["level"] for r in rows) == {1: 100, 2: 100, 3: 100, 4: 100}
    for r in rows:
        nums = _numbers(r)
        assert r["data_source"] == f"arith_l{r['level']}"
        if r["level"] == 1:
            assert len(nums) == 2 and all(1 <= x <= 9 for x in nums)
        elif r["level"] == 2:
            assert sorted(len(str(x)) for x in nums) == [1, 2]
        elif r["level"] == 3:
            assert len(nums) in (2, 3) and all(x <= 9 for x in nums)
        else:
            assert len(nums) == 2 and all(10 <= x <= 99 for x in nums)
    assert {r["level"] for r in generate(30, seed=0, levels=(2,))} == {2}
    assert {r["level"] for r in generate(30, seed=0)} == set(arith_task.DEFAULT_LEVELS)


def test_prompt_states_the_answer_format_with_worked_examples():
    prompt = generate(1, seed=0)[0]["prompt"]
    assert prompt[0]["role"] == "system" and "\\boxed{}" in prompt[0]["content"]
    assert prompt[-1]["role"] == "user"
    answers = [m["content"] for m in prompt if m["role"] == "assistant"]
    assert len(answers) == len(arith_task.EXAMPLES) >= 3
    for text in answers:  # each worked answer boxes the result of its own equation
        equation, boxed = text.split("\n")
        assert boxed == f"\\boxed{{{eval(equation.split('=')[0].replace('x', '*'))}}}"
        assert int(equation.split("=")[1]) == int(boxed[7:-1])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="levels"):
        generate(5, levels=(1, 9))
    with pytest.raises(ValueError, match="split"):
        generate(5, split="dev")


def test_builtin_task_files_load(tmp_path, tiny_tokenizer):
    train, test = write_builtin_task(tmp_path / "data", seed=5, n_train=40, n_test=12)
    assert validate_dataset(train) == 40 and validate_dataset(test) == 12
    items = load_prompts(train, tokenizer=tiny_tokenizer)
    assert [it.index for it in items] == list(range(40))
    assert items[0].prompt.endswith("<|im_start|>assistant\n")
    assert items[0].data_source.startswith("arith_l") and items[0].metadata == {"level": 1}
    assert write_builtin_task(tmp_path / "again", seed=5, n_train=40, n_test=12)  # same seed, same bytes
    assert open(train).read() == open(tmp_path / "again" / "arith_train.jsonl").read()


def test_make_arith_data_script(tmp_path):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_arith_data.py"
    main = runpy.run_path(str(script))["main"]
    args = ["--out-dir", str(tmp_path), "--n-train", "9", "--n-test", "4", "--levels", "1,3"]
    assert main(args) == 0
    rows = [json.loads(line) for line in open(tmp_path / "arith_train.jsonl")]
    assert len(rows) == 9 and {r["level"] for r in rows} == {1, 3}
    assert len(open(tmp_path / "arith_test.jsonl").readlines()) == 4
    with pytest.raises(SystemExit):
        main(["--out-dir", str(tmp_path), "--levels", "1,7"])


# ---------------------------------------------------------------------------------------------- the loader


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from entropy_openrlhf.models.tiny import make_tiny_model

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _chat(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


VERL_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "5", "style": "rule"},
        "extra_info": {"index": 7, "split": "train"},
    },
    {
        "data_source": "aime",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "42", "style": "rule"},
        "extra_info": {"index": 8, "split": "train"},
    },
]


def _check_verl_items(items, tok):
    assert [it.index for it in items] == [0, 1]
    assert items[0].prompt == _chat(tok, VERL_ROWS[0]["prompt"])
    assert items[1].prompt == _chat(tok, VERL_ROWS[1]["prompt"])
    assert [it.label for it in items] == ["5", "42"]
    assert [it.data_source for it in items] == ["math_dapo", "aime"]
    assert items[0].metadata == {"ability": "MATH", "index": 7, "split": "train"}


def test_openrlhf_schema_string_prompt(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2 + 3?", "label": "5"}, {"prompt": "1 + 1?", "label": 2}])
    items = load_prompts(path, tokenizer=tiny_tokenizer)
    assert items[0].prompt == _chat(tiny_tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    assert [it.label for it in items] == ["5", "2"]  # a number label becomes its string
    assert [it.index for it in items] == [0, 1] and items[0].data_source == "" and items[0].metadata == {}

    with_system = load_prompts(path, tokenizer=tiny_tokenizer, system_prompt="Think step by step.")
    assert with_system[0].prompt == _chat(
        tiny_tokenizer,
        [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2 + 3?"}],
    )
    raw = load_prompts(path, tokenizer=tiny_tokenizer, apply_chat_template=False)
    assert raw[0].prompt == "What is 2 + 3?"
    raw_sys = load_prompts(path, tokenizer=tiny_tokenizer, apply_chat_template=False, system_prompt="S.")
    assert raw_sys[0].prompt == "S.\n\nWhat is 2 + 3?"


def test_custom_keys_message_lists_and_max_samples(tmp_path, tiny_tokenizer):
    rows = [{"question": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "level": i} for i in range(5)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    items = load_prompts(path, tokenizer=tiny_tokenizer, input_key="question", label_key="answer", max_samples=3)
    assert [it.label for it in items] == ["0", "1", "2"]
    assert items[2].prompt == _chat(tiny_tokenizer, rows[2]["question"])
    assert items[2].metadata == {"level": 2}
    assert validate_dataset(path, input_key="question", label_key="answer") == 5


def test_blank_lines_are_skipped_and_index_counts_rows(tmp_path, tiny_tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a", "label": "1"}\n\n  \n{"prompt": "b", "label": "2"}\n\n')
    items = load_prompts(str(path), tokenizer=tiny_tokenizer)
    assert [(it.index, it.label) for it in items] == [(0, "1"), (1, "2")]


def test_verl_schema_jsonl_json_parquet_and_saved_dataset(tmp_path, tiny_tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    kw = dict(tokenizer=tiny_tokenizer, label_key="reward_model.ground_truth")
    jsonl = _jsonl(tmp_path / "d.jsonl", VERL_ROWS)
    array = tmp_path / "d.json"
    array.write_text(json.dumps(VERL_ROWS))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(saved))
    saved_dict = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(str(saved_dict))

    with_bom = tmp_path / "bom.json"  # a pretty-printed array saved by an editor that writes a byte-order mark
    with_bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(VERL_ROWS, indent=2).encode())

    for path in (jsonl, array, with_bom, parquet, saved, saved_dict):
        assert validate_dataset(str(path), label_key="reward_model.ground_truth") == 2
        _check_verl_items(load_prompts(str(path), **kw), tiny_tokenizer)


def test_openrlhf_schema_parquet_and_saved_dataset(tmp_path, tiny_tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input": "What is 2 + 3?", "target": 5}, {"input": "What is 1 + 1?", "target": 2}]
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    for path in (parquet, saved):
        items = load_prompts(str(path), tokenizer=tiny_tokenizer, input_key="input", label_key="target")
        assert [it.label for it in items] == ["5", "2"]
        assert items[1].prompt == _chat(tiny_tokenizer, [{"role": "user", "content": "What is 1 + 1?"}])


def test_tokenizer_problems(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl: line 1: field 'prompt': .*apply_chat_template=true"):
        load_prompts(path, tokenizer=tiny_tokenizer, apply_chat_template=False)

    class NoTemplate:
        chat_template = None

    with pytest.raises(DatasetError, match="no chat template"):
        load_prompts(path, tokenizer=NoTemplate())


def _bad_jsonl(tmp_path, text):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


GOOD = '{"prompt": "What is 1 + 1?", "label": "2"}\n'

# (file content, the field or words the message must name, the row)
BAD_JSONL = {
    "missing prompt": (GOOD + '{"label": "2"}\n', "field 'prompt': missing", "line 2"),
    "missing label": (GOOD + GOOD + '{"prompt": "x"}\n', "field 'label': missing", "line 3"),
    "null label": ('{"prompt": "x", "label": null}\n', "field 'label': missing", "line 1"),
    "prompt is a number": ('{"prompt": 42, "label": "2"}\n', "field 'prompt': must be a string or", "line 1"),
    "label is a dict": (GOOD + '{"prompt": "x", "label": {"a": 1}}\n', "field 'label': must be a string", "line 2"),
    "label is a list": ('{"prompt": "x", "label": ["1"]}\n', "field 'label': must be a string", "line 1"),
    "label is a bool": ('{"prompt": "x", "label": true}\n', "field 'label': must be a string", "line 1"),
    "empty label": ('{"prompt": "x", "label": " "}\n', "field 'label': empty label", "line 1"),
    "empty prompt": (GOOD + '{"prompt": "  ", "label": "2"}\n', "field 'prompt': empty prompt", "line 2"),
    "no messages": ('{"prompt": [], "label": "2"}\n', "field 'prompt': empty prompt", "line 1"),
    "all messages empty": (
        '{"prompt": [{"role": "user", "content": ""}], "label": "2"}\n',
        "field 'prompt': empty prompt",
        "line 1",
    ),
    "message without content": (
        '{"prompt": [{"role": "user"}], "label": "2"}\n',
        "field 'prompt': message 0 content must be a string",
        "line 1",
    ),
    "message with a bad role": (
        '{"prompt": [{"role": "robot", "content": "x"}], "label": "2"}\n',
        "field 'prompt': message 0 has role 'robot'",
        "line 1",
    ),
    "message is a string": ('{"prompt": ["hi"], "label": "2"}\n', "field 'prompt': message 0 must be an", "line 1"),
    "row is a list": (GOOD + '["x", "2"]\n', "a row must be an object", "line 2"),
    "invalid JSON": (GOOD + '{"prompt": "x", "label": }\n', "invalid JSON", "line 2"),
    "non-UTF-8": (GOOD.encode() + b'{"prompt": "caf\xe9", "label": "2"}\n', "not valid UTF-8", "line 2"),
    "data_source not a string": (
        '{"prompt": "x", "label": "2", "data_source": 3}\n',
        "field 'data_source': must be a string",
        "line 1",
    ),
    "extra_info not an object": (
        '{"prompt": "x", "label": "2", "extra_info": "s"}\n',
        "field 'extra_info': must be an object",
        "line 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_rows_name_file_row_and_field(tmp_path, tiny_tokenizer, case):
    text, what, row = BAD_JSONL[case]
    path = _bad_jsonl(tmp_path, text)
    for check in (lambda: validate_dataset(path), lambda: load_prompts(path, tokenizer=tiny_tokenizer)):
        with pytest.raises(DatasetError) as e:
            check()
        message = str(e.value)
        assert message.startswith(f"{path}: {row}: ")
        assert what in message and "\n" not in message
        assert isinstance(e.value, ValueError)


def test_dotted_label_key_missing_part_names_the_key(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError, match=r"line 1: field 'reward_model\.ground_truth': missing"):
        validate_dataset(path, label_key="reward_model.ground_truth")


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("empty.jsonl", "", "the dataset is empty"),
        ("blank.jsonl", "\n  \n", "the dataset is empty"),
        ("empty.json", "[]", "the dataset is empty"),
        ("bad.json", '[{"prompt": "x",', "invalid JSON"),
        ("data.csv", "prompt,label\nx,1\n", "unknown format"),
        ("broken.parquet", "not parquet at all", "not a readable parquet file"),
    ],
)
def test_bad_files(tmp_path, tiny_tokenizer, name, content, words):
    path = tmp_path / name
    path.write_text(content)
    for check in (lambda: validate_dataset(str(path)), lambda: load_prompts(str(path), tokenizer=tiny_tokenizer)):
        with pytest.raises(DatasetError, match=re.escape(words)) as e:
            check()
        assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_missing_path_and_non_dataset_folder(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: no such file or folder"):
        validate_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(DatasetError, match=r"folder: not a saved HF dataset folder"):
        validate_dataset(str(tmp_path / "folder"))


def test_parquet_and_saved_dataset_errors_name_the_row(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "x", "label": "1"}, {"prompt": "", "label": "2"}, {"prompt": "z", "label": "3"}]
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    with pytest.raises(DatasetError, match=r"d\.parquet: row 1: field 'prompt': empty prompt"):
        validate_dataset(str(parquet))

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    with pytest.raises(DatasetError, match=r"saved: row 1: field 'prompt': empty prompt"):
        validate_dataset(str(saved))

    no_label = tmp_path / "no_label.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x", "answer": "1"}]), no_label)
    with pytest.raises(DatasetError, match=r"row 0: field 'label': missing"):
        validate_dataset(str(no_label))

    splits = tmp_path / "splits"
    ds = datasets.Dataset.from_list(rows[:1])
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(splits))
    with pytest.raises(DatasetError, match=r"several splits \(train, test\).*splits/train"):
        validate_dataset(str(splits))


def test_chat_template_failure_names_the_row(tmp_path, tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "label": "1"}])
    with pytest.raises(DatasetError, match=r"line 1: field 'prompt': chat template failed: roles must alternate"):
        load_prompts(path, tokenizer=tok)


def test_prompts_keep_their_chat_messages_for_rollout_functions(tmp_path, tiny_tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Add 2 and 2."}], "label": "4"}, {"prompt": "Add 3.", "label": "3"}]
    _jsonl(tmp_path / "p.jsonl", rows)
    items = load_prompts(str(tmp_path / "p.jsonl"), tokenizer=tiny_tokenizer, system_prompt="Be brief.")
    assert items[0].messages == [{"role": "user", "content": "Add 2 and 2."}]
    assert items[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 3."}]
    assert items[1].prompt == _chat(tiny_tokenizer, items[1].messages)  # the engine input is made from them
    _jsonl(tmp_path / "q.jsonl", rows[1:])
    (plain,) = load_prompts(str(tmp_path / "q.jsonl"), tokenizer=tiny_tokenizer, apply_chat_template=False)
    assert plain.messages is None and plain.prompt == "Add 3."  # no template, no messages
