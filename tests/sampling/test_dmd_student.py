"""The DMD student's own sampler (issue 22) against the reference's numbers (tests/data/reference/dmd/).

The grid, the integer timesteps, the stochastic gate and the per-step ancestral std come from the
reference's DMDStudentScheduler; the open-loop trajectory feeds it fixed model outputs and noise; the
T2V / TI2V scenarios are whole seed-1234 runs of the reference's tiny MoE package, which agree within the
MoE bars (the reference runs its routed experts in bf16 even in fp32). Then the pack's side: ``auto``
picks the sampler for a package marked as a DMD student, Refine and explicit sigmas refuse it, guidance
above 1 warns once, and offload modes / lockstep CFG / the step cache / fp8 / LoRA compose with it.
"""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core import OFFLOAD_MODES, load_pipeline
from lingbot_core.testing.fixtures import write_package
from lingbot_core.sampling.scheduling import (
    DMD_SCHEDULER_CLASS, DMDStudentSampler, ddim_ancestral_std, dmd_package_reason, dmd_settings, dmd_sigmas,
    model_timestep,
)

REF = Path(__file__).resolve().parents[1] / "data" / "reference"
DMD = REF / "dmd"
PROMPT = (REF / "inputs" / "prompt.json").read_text(encoding="utf-8")
RUN = dict(height=64, width=96, num_frames=9, steps=8, guidance_scale=1.0, shift=3.0, seed=1234)
REL_RMS, MAX_ABS = 5e-3, 5e-2  # the MoE bars of the reference vectors (frames in [0, 1])
# Latents, not frames, below the reference runs: the VAE decode would dominate and is tested elsewhere.
TINY = dict(height=32, width=32, num_frames=5, steps=8, guidance_scale=1.0, shift=3.0, output_type="latent")


def vectors(name: str) -> dict:
    with np.load(DMD / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def rel_rms(actual, expected) -> float:
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.sqrt(np.mean((a - e) ** 2)) / np.sqrt(np.mean(e ** 2)))


# ---------------------------------------------------------------------------------------------
# The sampler alone
# ---------------------------------------------------------------------------------------------


def test_grid_timesteps_and_model_timesteps_are_the_references():
    ref = vectors("components_dmd_sched")
    sampler = DMDStudentSampler(dmd_sigmas(8, 3.0), torch.Generator())
    np.testing.assert_array_equal(sampler.sigmas.numpy(), ref["n8_shift3.sigmas"])
    assert sampler.sigmas.dtype == torch.float32
    np.testing.assert_array_equal(sampler.timesteps.numpy(), ref["n8_shift3.timesteps"])
    np.testing.assert_array_equal(model_timestep(sampler.timesteps, torch.float32).numpy(), ref["n8_shift3.model_t_fp32"])
    np.testing.assert_array_equal(model_timestep(sampler.timesteps, torch.bfloat16).numpy(), ref["n8_shift3.model_t_bf16"])
    for name in ("moe_dmd_t2v", "moe_dmd_ti2v"):
        v = vectors(name)
        np.testing.assert_array_equal(sampler.sigmas.numpy(), v["scheduler_sigmas"])
        np.testing.assert_array_equal(sampler.timesteps.numpy(), v["scheduler_timesteps"])


def test_stochastic_gate_and_ancestral_std_are_the_references():
    """Steps 1-7 ancestral (the 7th sigma, 0.500999, is above 0.5), the 8th the Euler landing; the std of
    each step equals the reference's to 2 ulp (2.4e-7 relative): the reference's own fp32 arithmetic is 2 ulp
    from the correctly rounded value at steps 4 and 6, so no other operation order can be closer everywhere."""
    ref = vectors("components_dmd_sched")
    sampler = DMDStudentSampler(dmd_sigmas(8, 3.0), torch.Generator())
    np.testing.assert_array_equal(sampler.stochastic.numpy(), ref["n8_shift3.stochastic"])
    assert sampler.stochastic.tolist() == [True] * 7 + [False]
    np.testing.assert_array_max_ulp(sampler.ancestral_std.numpy(), ref["n8_shift3.ancestral_std"], maxulp=2)
    assert sampler.ancestral_std[0] == sampler.sigmas[1]  # the first step renoises fully to sigma_next
    for name in ("moe_dmd_t2v", "moe_dmd_ti2v"):
        v = vectors(name)
        np.testing.assert_array_equal(sampler.stochastic.numpy(), v["scheduler_stochastic"])
        np.testing.assert_array_max_ulp(sampler.ancestral_std.numpy(), v["scheduler_ancestral_std"], maxulp=2)


def ddim_std_oracle(sigma: float, sigma_next: float, eta: float) -> float:
    """DDIM's eta-ancestral std written with alpha-bar (VP form), mapped to flow units, capped at sigma_next."""
    def alpha_bar(s):
        return (1 - s) ** 2 / ((1 - s) ** 2 + s ** 2)

    a, a_next = alpha_bar(sigma), alpha_bar(sigma_next)
    var_vp = eta ** 2 * (1 - a_next) / (1 - a) * (1 - a / a_next)
    scale_next = np.sqrt((1 - sigma_next) ** 2 + sigma_next ** 2)
    return min(np.sqrt(max(var_vp, 0.0)) * scale_next, sigma_next)


@pytest.mark.parametrize("eta", [0.5, 1.0, 1.5])
def test_ancestral_std_matches_an_alpha_bar_oracle_and_never_exceeds_sigma_next(eta):
    """Over many grids. eta 1.5 (a student distilled with it states ddim_eta in its scheduler config) asks for
    more fresh noise than the target level holds: the std is capped at sigma_next and the step stays finite."""
    pairs = np.concatenate([np.stack([g[:-1], g[1:]], 1) for steps in (2, 4, 8, 12, 30) for shift in (1.0, 3.0, 7.0)
                            for g in [np.append(dmd_sigmas(steps, shift), 0.0).astype(np.float32)]])
    pairs = pairs[pairs[:, 1] > 0]
    sigma, sigma_next = torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1])
    std = ddim_ancestral_std(sigma, sigma_next, eta)
    want = np.array([ddim_std_oracle(float(s), float(n), eta) for s, n in pairs])
    np.testing.assert_allclose(std.numpy(), want, rtol=1e-5, atol=1e-6)  # fp32 cancellation at small sigma
    assert bool((std <= sigma_next).all())
    if eta > 1:
        assert int((std == sigma_next).sum()) > len(pairs) // 2  # the cap is what decides here
    sampler = DMDStudentSampler(dmd_sigmas(8, 3.0), torch.Generator().manual_seed(0),
                                **dmd_settings({"_class_name": DMD_SCHEDULER_CLASS, "ddim_eta": eta}))
    x = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    for t in sampler.timesteps:
        x = sampler.step(-0.3 * x, t, x).prev_sample
        assert torch.isfinite(x).all()


def test_open_loop_trajectory_is_the_references():
    """Fixed model outputs and fixed noise through the 8 steps (ancestral x0/x1 split, then Euler)."""
    ref = vectors("components_dmd_sched")
    sampler = DMDStudentSampler(dmd_sigmas(8, 3.0), torch.Generator())
    outputs, samples = torch.from_numpy(ref["openloop.model_outputs"]), torch.from_numpy(ref["openloop.samples"])
    noise = iter(torch.from_numpy(ref["openloop.noise"]))
    x = samples[0]
    for i in range(8):
        x = sampler.transition(i, outputs[i], x, next(noise) if sampler.stochastic[i] else None)
        delta = float((x - samples[i + 1]).abs().max())
        assert delta <= 1e-5, f"step {i}: max |delta| {delta:.3g}"
    assert next(noise, None) is None  # one noise per ancestral step, all used


@pytest.mark.parametrize("name", ["t2v", "ti2v"])
def test_ancestral_noise_comes_from_the_run_generator_in_the_reference_order(name):
    """Seed 1234: (TI2V: the first-frame posterior draw), the initial noise, then one randn of the latent's
    shape per ancestral step and none on the Euler landing. Read back from the sampler with zero velocity
    on a zero latent, where a step's output is exactly std * noise."""
    v = vectors(f"moe_dmd_{name}")
    gen = torch.Generator("cpu").manual_seed(1234)
    if name == "ti2v":
        eps = torch.randn(v["posterior_eps"].shape, generator=gen, dtype=torch.float32)
        np.testing.assert_array_equal(eps.numpy(), v["posterior_eps"])
    noise = torch.randn(v["noise"].shape, generator=gen, dtype=torch.float32)
    np.testing.assert_array_equal(noise.numpy(), v["noise"])
    sampler = DMDStudentSampler(dmd_sigmas(8, 3.0), gen)
    zero = torch.zeros_like(noise)
    drawn = []
    for i, t in enumerate(sampler.timesteps):
        out = sampler.step(zero, t, zero).prev_sample
        if sampler.stochastic[i]:
            drawn.append((out / sampler.ancestral_std[i])[0])
        else:
            assert torch.equal(out, zero)
    np.testing.assert_allclose(torch.stack(drawn).numpy(), v["ancestral_noise"], rtol=1e-6, atol=1e-6)
    # Nothing else was drawn: the generator stands where 7 draws after the initial noise leave it.
    expected = torch.Generator("cpu").manual_seed(1234)
    if name == "ti2v":
        torch.randn(v["posterior_eps"].shape, generator=expected)
    for _ in range(8):
        torch.randn(v["noise"].shape, generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())


# ---------------------------------------------------------------------------------------------
# Whole runs on the reference's tiny MoE package
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_moe(tmp_path_factory):
    """The reference's tiny MoE package: its DiT (vendored in dmd/moe_transformer) with the text encoder,
    processor, VAE and scheduler of package-dense (the reference's package-moe has the same files)."""
    root = tmp_path_factory.mktemp("reference") / "package-moe"
    root.mkdir()
    shutil.copy(REF / "package-dense" / "model_index.json", root)
    for sub in ("processor", "text_encoder", "vae", "scheduler"):
        shutil.copytree(REF / "package-dense" / sub, root / sub)
    shutil.copytree(DMD / "moe_transformer", root / "transformer")
    pipe = load_pipeline(root, device="cpu")
    assert pipe.transformer.compute_dtype == torch.float32 and pipe.own_sampler == "unipc"
    yield pipe
    pipe.release()


@pytest.fixture(scope="module")
def scenario_runs(reference_moe):
    """T2V and TI2V with the reference's settings and sampler="dmd_student"; the DiT's timesteps recorded."""
    runs = {}
    for name in ("t2v", "ti2v"):
        timesteps = []
        hook = reference_moe.transformer.register_forward_pre_hook(lambda m, a: timesteps.append(float(a[1][0])))
        try:
            image = Image.open(REF / "inputs" / "first_frame.png") if name == "ti2v" else None
            latent = reference_moe.generate(PROMPT, image=image, output_type="latent", sampler="dmd_student", **RUN)
        finally:
            hook.remove()
        runs[name] = dict(latent=latent, frames=reference_moe.decode(latent).numpy(), timesteps=timesteps)
    return runs


@pytest.mark.parametrize("name", ["t2v", "ti2v"])
def test_frames_within_the_moe_bars(scenario_runs, name):
    v = vectors(f"moe_dmd_{name}")
    run = scenario_runs[name]
    assert run["timesteps"] == v["dit_timesteps"].tolist()  # one DiT forward per step (guidance 1), fp32 integers
    frames_rel, frames_max = rel_rms(run["frames"], v["frames"]), float(np.abs(run["frames"] - v["frames"]).max())
    latent_rel = rel_rms(run["latent"].numpy(), v["final_latent"])
    print(f"dmd {name}: frames rel-RMS {frames_rel:.3g}, max {frames_max:.3g}; final latent rel-RMS {latent_rel:.3g}")
    assert frames_rel <= REL_RMS and frames_max <= MAX_ABS, (frames_rel, frames_max)
    assert latent_rel <= REL_RMS, latent_rel


# ---------------------------------------------------------------------------------------------
# The pack: recognition, auto, refusals, warnings, composition
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dmd_package(tmp_path_factory):
    """A tiny fp32 MoE package whose scheduler config names DMDStudentScheduler (no 'dmd' in its folder name)."""
    return write_package(tmp_path_factory.mktemp("student") / "lingbot-tiny-student", moe=True, fp32=True, seed=1,
                         refiner=False, dmd=True)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def student_and_log(dmd_package):
    """The DMD package loaded once, with what the loader logged."""
    log, core = _Messages(), logging.getLogger("lingbot_core")
    level = core.level
    core.addHandler(log)
    core.setLevel(logging.INFO)
    try:
        pipe = load_pipeline(dmd_package, device="cpu")
    finally:
        core.removeHandler(log)
        core.setLevel(level)
    yield pipe, log.messages
    pipe.release()


@pytest.fixture
def student(student_and_log):
    return student_and_log[0]


def test_recognition_by_scheduler_class_or_folder_name():
    assert dmd_package_reason({"_class_name": "DMDStudentScheduler"}, "/models/lingbot-video-moe-30b-a3b")
    assert dmd_package_reason({"_class_name": "FlowUniPCMultistepScheduler"}, "/models/lingbot-video-moe-DMD-30b-a3b/")
    assert dmd_package_reason({}, "/models/org/lingbot-video-moe-dmd-30b-a3b")
    assert dmd_package_reason({"_class_name": "FlowUniPCMultistepScheduler"}, "/models/dmd/lingbot-video-moe-30b-a3b") is None
    assert dmd_package_reason({}, None) is None


def test_auto_picks_dmd_student_for_a_marked_package_and_unipc_otherwise(student_and_log, reference_moe):
    student, messages = student_and_log
    assert any("DMD-distilled student" in m and DMD_SCHEDULER_CLASS in m for m in messages), messages
    assert student.own_sampler == "dmd_student" and reference_moe.own_sampler == "unipc"

    def run(pipe, sampler):
        return pipe.generate("a cat", seed=3, sampler=sampler, **TINY)

    auto = run(student, "auto")
    assert torch.equal(auto, run(student, "dmd_student"))
    assert (auto - run(student, "unipc")).abs().max() > 1e-2
    assert torch.equal(run(reference_moe, "auto"), run(reference_moe, "unipc"))


def test_custom_sigmas_are_refused(student):
    with pytest.raises(ValueError, match="sigmas cannot be used with sampler='dmd_student'"):
        student.generate("a cat", sigmas=[1.0, 0.5], **TINY)
    with pytest.raises(ValueError, match="sigmas cannot be used"):
        student.generate("a cat", sampler="auto", sigmas=[1.0, 0.5], **TINY)


def test_denoise_stage_needs_the_run_generator_for_dmd_student(student):
    embeds = student.encode_prompt("a cat", guidance_scale=1.0, num_frames=5)
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pass the run's generator"):
        student.denoise(embeds, latents, sigmas=dmd_sigmas(8, 3.0), guidance_scale=1.0, sampler="auto")
    gen = torch.Generator().manual_seed(9)
    out = student.denoise(embeds, latents, sigmas=dmd_sigmas(8, 3.0), guidance_scale=1.0, sampler="auto", generator=gen)
    assert torch.isfinite(out).all()


def test_refine_refuses_dmd_student(refiner_pipe):
    frames = np.full((5, 32, 32, 3), 0.5, dtype=np.float32)
    assert refiner_pipe.own_sampler == "unipc"
    with pytest.raises(ValueError, match="the refiner keeps flow UniPC"):
        refiner_pipe.refine(frames, "a cat", height=32, width=32, steps=2, sampler="dmd_student")


def test_refine_with_auto_keeps_unipc_for_a_dmd_packages_refiner(tmp_path):
    """A DMD student package's refiner is no student: Refine with sampler "auto" runs flow UniPC (the
    same frames as "unipc") instead of refusing dmd_student."""
    root = write_package(tmp_path / "lingbot-tiny-student", moe=True, fp32=True, seed=1, refiner=True, dmd=True)
    pipe = load_pipeline(root, transformer_subfolder="refiner", device="cpu")
    try:
        assert pipe.dmd_reason  # the package is recognised as a student
        frames = np.full((5, 32, 32, 3), 0.5, dtype=np.float32)
        run = dict(height=32, width=32, steps=2, seed=3, output_type="latent")
        auto = pipe.refine(frames, "a cat", sampler="auto", **run)
        assert torch.equal(auto, pipe.refine(frames, "a cat", sampler="unipc", **run))
        assert pipe.own_sampler == "unipc"
    finally:
        pipe.release()


def test_the_packages_own_ddim_eta_is_honoured(tmp_path):
    """A student distilled with another eta states it in its scheduler config. With ddim_eta 0 an
    ancestral step lands on (1 - s') x0 + s' x1 = x + (s' - s) v: flow Euler on the student's grid, an
    independent oracle (a dense DiT: no routing). Only the DiT's timesteps differ (the student's are
    truncated to integers, Euler's are sigma * 1000): 5e-3 apart; eta 1 (the default) adds fresh noise
    of the latent's own size on the ancestral steps."""
    root = write_package(tmp_path / "lingbot-tiny-student", moe=False, fp32=True, seed=1, refiner=False, dmd=True)
    config_file = root / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    assert config["ddim_eta"] == 1.0
    config_file.write_text(json.dumps(dict(config, ddim_eta=0.0)), encoding="utf-8")
    pipe = load_pipeline(root, device="cpu")
    try:
        student = pipe.generate("a cat", seed=3, sampler="dmd_student", **TINY)
        euler = pipe.generate("a cat", seed=3, sampler="euler", sigmas=dmd_sigmas(8, 3.0).tolist(), **TINY)
    finally:
        pipe.release()
    assert torch.isfinite(student).all() and euler.abs().max() > 0.1
    assert (student - euler).abs().max().item() <= 2e-2, (student - euler).abs().max().item()


def test_guidance_above_one_warns_once_and_lockstep_gives_the_same_frames(student, caplog):
    cfg = dict(TINY, guidance_scale=2.0, negative_prompt="blurry")  # a short negative: a cheap text encode
    with caplog.at_level(logging.WARNING, logger="lingbot_core"):
        a = student.generate("a cat", seed=4, **cfg)
    warnings = [r for r in caplog.records if "applies it twice" in r.getMessage()]
    assert len(warnings) == 1
    student.set_speed(cfg_lockstep=False)
    try:
        b = student.generate("a cat", seed=4, **cfg)
    finally:
        student.set_speed(cfg_lockstep=True)
    assert torch.equal(a, b)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lingbot_core"):
        student.generate("a cat", seed=4, **TINY)
    assert not [r for r in caplog.records if "applies it twice" in r.getMessage()]


def test_same_result_in_every_offload_mode(student):
    reference = student.generate("a cat", seed=5, **TINY)
    try:
        for mode in OFFLOAD_MODES:
            student.set_offload(mode, blocks_on_gpu=1 if mode == "block" else None)
            assert torch.equal(student.generate("a cat", seed=5, **TINY), reference), mode
    finally:
        student.set_offload("none")


def test_step_cache_on_eight_steps_warns_and_runs(student, caplog):
    with caplog.at_level(logging.WARNING, logger="lingbot_core"):
        latent = student.generate("a cat", seed=6, step_cache=0.1, **TINY)
    assert any("step_cache=0.1 with 8 steps" in r.getMessage() for r in caplog.records)
    assert torch.isfinite(latent).all()


def test_fp8_student_with_a_lora_in_block_offload(dmd_package, tmp_path):
    from support.lora_files import lightx2v_lora

    lora, _ = lightx2v_lora(tmp_path / "lora.safetensors")
    pipe = load_pipeline(dmd_package, device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        plain = pipe.generate("a cat", seed=7, **TINY)
        pipe.set_loras([(lora, 1.0)])
        with_lora = pipe.generate("a cat", seed=7, **TINY)
        pipe.set_offload("block", blocks_on_gpu=0)
        assert torch.equal(pipe.generate("a cat", seed=7, **TINY), with_lora)
    finally:
        pipe.release()
    assert torch.isfinite(with_lora).all() and (with_lora - plain).abs().max() > 1e-3


def test_cli_sampler_choices():
    from lingbot_core.cli import build_parser

    base = ["generate", "--model_dir", "pkg", "--prompt", "a cat", "--output", "out.mp4"]
    assert build_parser().parse_args(base).sampler == "auto"
    assert build_parser().parse_args(base + ["--sampler", "dmd_student"]).sampler == "dmd_student"
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--sampler", "ddim"])
