"""Prompt schedules (issue 50): several prompts for one video, one per context window, on the tiny dense package.

Expected numbers come from the documented rules, written out here: even starts ``k * num_frames // n``; the
windows of a 25-frame video with context_frames 9 / overlap 4 are latent spans [0, 3), [2, 5), [4, 7) (7 latent
frames, windows of 3 sharing >= 1), whose centre pixel frames are 2 (start + end - 1) = 4, 12, 20; a window is
conditioned on the part holding its centre frame.
"""

from contextlib import contextmanager

import pytest
import torch

from lingbot_core.prompts.prompt_schedule import (
    MAX_PARTS, check_schedule, parse_starts, schedule_from_json, split_parts,
)

SIZE = dict(height=32, width=32)
RUN = dict(SIZE, num_frames=25, steps=1, seed=3, context_frames=9, context_overlap=4, output_type="latent")
CENTRES = [4, 12, 20]  # pixel frames at the centres of the three windows of RUN
STORY = ["a cat sleeps", "a red boat sails on a calm lake at dawn", "a tall tree"]  # three lengths of text


@contextmanager
def text_per_dit_call(pipe):
    """The text states each DiT forward received (a list [positive, negative] under lockstep CFG)."""
    seen = []

    def hook(module, args, kwargs):
        text = args[2] if len(args) > 2 else kwargs["encoder_hidden_states"]
        seen.append([t.detach().clone() for t in text] if isinstance(text, (list, tuple)) else [text.detach().clone()])

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def encoder_calls(pipe):
    calls = []
    handle = pipe.text_encoder.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_identical_prompts_give_the_single_prompt_result_bit_for_bit(dense_pipe):
    single = dense_pipe.generate("a cat sleeps", negative_prompt="blurry", **RUN)
    assert torch.equal(dense_pipe.generate(["a cat sleeps"] * 3, negative_prompt="blurry", **RUN), single)
    assert torch.equal(dense_pipe.generate(["a cat sleeps"] * 3, negative_prompt=["blurry"] * 3, prompt_starts=[0, 5, 20],
                                           **RUN), single)
    # and not by accident: another part changes the video
    assert not torch.equal(dense_pipe.generate(["a cat sleeps", "a cat sleeps", "a tall tree"], negative_prompt="blurry",
                                               **RUN), single)


@pytest.mark.parametrize("parts,starts,expected", [
    (3, None, [0, 1, 2]),  # even: 0, 8, 16
    (3, [0, 5, 20], [0, 1, 2]),  # window 1 (frames 0-8) straddles parts 1 and 2; its centre, frame 4, is part 1's
    (2, [0, 13], [0, 0, 1]),  # window 2 (frames 5-16) straddles the change at 13; its centre, frame 12, is part 1's
    (2, None, [0, 1, 1]),  # even: 0, 12; centre 12 is part 2's first frame
])
def test_each_window_receives_its_parts_embeddings(dense_pipe, parts, starts, expected):
    story = STORY[:parts]
    negatives = ["dark", "noisy", "grainy"][:len(story)]
    encoded = [dense_pipe.encode_prompt(p, n, num_frames=25) for p, n in zip(story, negatives)]
    assert len({e.positive.shape[1] for e in encoded}) == len(story)  # the parts are told apart by their states too
    with text_per_dit_call(dense_pipe) as seen:
        dense_pipe.generate(story, prompt_starts=starts, negative_prompt=negatives, **RUN)
    assert len(seen) == 3  # 1 step x 3 windows, cond and uncond in one lockstep call
    for call, part in zip(seen, expected):
        positive, negative = call
        assert torch.equal(positive.cpu().float(), encoded[part].positive.float())
        assert torch.equal(negative.cpu().float(), encoded[part].negative.float())


def test_each_distinct_text_is_encoded_once(dense_pipe):
    with encoder_calls(dense_pipe) as calls:
        dense_pipe.generate(STORY, **RUN)
    assert len(calls) == 3 + 1  # three parts, one shared default negative
    with encoder_calls(dense_pipe) as calls:
        dense_pipe.generate(STORY, seed=9, **{k: v for k, v in RUN.items() if k != "seed"})
    assert calls == []  # another seed: every part from the cache
    with encoder_calls(dense_pipe) as calls:
        dense_pipe.generate(["a dog", "a dog", "a fox"], negative_prompt=["dark", "dark", "noisy"], **RUN)
    assert len(calls) == 2 + 2


def test_starts_spread_evenly():
    assert check_schedule(["a", "b", "c"], 121).starts == (0, 40, 80)
    assert check_schedule(["a", "b", "c", "d"], 25).starts == (0, 6, 12, 18)
    assert check_schedule(["a", "b"], 9).starts == (0, 4)
    schedule = check_schedule(["a", "b", "c"], 121, negative_prompt="n")
    assert schedule.negatives == ("n", "n", "n") and schedule.describe() == "part 1: frames 0-39; part 2: frames 40-79; part 3: frames 80-120"


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_starts=[0, 10, 25]), r"part 3's start 25 is past the video's last frame \(24"),
    (dict(prompt_starts=[0, 12, 8]), r"strictly increasing: part 3's start 8 comes before part 2's start 12"),
    (dict(prompt_starts=[0, 8, 8]), r"part 3's start 8 repeats part 2's start 8"),
    (dict(prompt_starts=[2, 8, 16]), r"must begin with 0"),
    (dict(prompt_starts=[0, 8]), r"prompt_starts has 2 start frames for 3 prompts"),
    (dict(prompt_starts=[0, -4, 8]), r"strictly increasing"),
    (dict(negative_prompt=["a", "b"]), r"negative_prompt has 2 parts for 3 prompts"),
    (dict(prompt=["a cat", "  ", "a dog"]), r"part 2 of 3 is empty"),
    (dict(prompt=["a", "b", "c", "d"]), r"4 parts but the video is sampled in only 3 context windows.*Lower context_frames"),
    (dict(prompt_starts=[0, 13, 20]), r"part 2 \(frames 13-19\) is the part of no context window \(their centre frames: 4, 12, 20\)"),
    # the named length is RUN's, which the tests above run with
    (dict(context_frames=0), r"needs context windows.*: set context_frames \(e\.g\. context_frames 9 with context_overlap 4"),
    (dict(prompt="a cat", prompt_starts=[0]), r"prompt_starts needs a list of prompts"),
    (dict(prompt=["a", "{not json"]), r"part 2: prompt starts with '\{' but is not valid JSON"),
    (dict(prompt=["p"] * (MAX_PARTS + 1)), rf"{MAX_PARTS + 1} parts; at most {MAX_PARTS}"),
])
def test_bad_schedules_are_refused_before_any_work(dense_pipe, kwargs, message):
    run = {**RUN, "prompt": STORY, **kwargs}
    with encoder_calls(dense_pipe) as calls, text_per_dit_call(dense_pipe) as dit:
        with pytest.raises(ValueError, match=message):
            dense_pipe.generate(run.pop("prompt"), **run)
    assert calls == [] and dit == []


def test_node_text_format():
    caption = '{"caption": {"scene": "a boat"},\n "duration": 2}'
    assert split_parts(f"a cat\n---\n{caption}\n  ---  \nthe end\n") == ["a cat", caption, "the end"]
    assert split_parts("one prompt, with --- inside a line") == ["one prompt, with --- inside a line"]
    with pytest.raises(ValueError, match="part 2 of 3 is empty"):
        split_parts("a\n---\n\n---\nc")
    assert parse_starts("0, 48 96") == [0, 48, 96] and parse_starts("  ") is None
    with pytest.raises(ValueError, match="whole frame numbers"):
        parse_starts("0, 4.5")


def test_prompt_file_lists():
    assert schedule_from_json({"caption": "x"}) is None and schedule_from_json([{"caption": "x"}]) is None
    prompts, starts = schedule_from_json([{"caption": {"scene": "a"}, "start_frame": 0}, {"caption": "b", "start_frame": 8}])
    assert prompts == ['{"scene":"a"}', "b"] and starts == [0, 8]
    assert schedule_from_json(["a", {"caption": "b", "duration": 1}]) == (["a", "b"], None)
    with pytest.raises(ValueError, match="start_frame on 1 of its 2 parts"):
        schedule_from_json([{"caption": "a", "start_frame": 0}, "b"])


def test_cli_prompt_json_list_is_a_schedule(packages, tmp_path, capsys, caplog):
    import json
    import logging

    from lingbot_core.cli import main
    from lingbot_core.files.video_io import read_video_file

    parts = [{"caption": {"scene": "a kite"}, "duration": 9, "start_frame": 0}, {"caption": "a boat", "start_frame": 6}]
    (tmp_path / "story.json").write_text(json.dumps(parts), encoding="utf-8")
    common = ["generate", "--model_dir", str(packages["dense"]), "--prompt_json", str(tmp_path / "story.json"),
              "--height", "32", "--width", "32", "--steps", "1", "--device", "cpu", "--num_frames", "13"]
    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        rc = main(common + ["--context_frames", "9", "--context_overlap", "4", "--output", str(tmp_path / "story.mp4")])
    assert rc == 0, capsys.readouterr().err
    # --num_frames sets the length (the first part's duration of 9 s does not); the parts as given
    assert "prompt schedule: part 1: frames 0-5; part 2: frames 6-12; the windows' parts: 1, 2" in caplog.text
    assert read_video_file(tmp_path / "story.mp4", max_frames=100, max_side=64)[0].shape[0] == 13
    assert main(common + ["--output", str(tmp_path / "none.mp4")]) == 2  # no windows
    assert "needs context windows" in capsys.readouterr().err and not (tmp_path / "none.mp4").exists()
