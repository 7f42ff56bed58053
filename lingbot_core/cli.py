"""Command line: ``python -m lingbot_core generate --model_dir DIR --mode t2v --prompt_json p.json ...`` (or, instead
of ``--model_dir``, ``--transformer_file F.gguf --text_encoder_file qwen3vl_4b_bf16.safetensors --vae_file
wan_2.1_vae.safetensors``; ``--video in.mp4 --denoise 0.5`` for video-to-video),
``python -m lingbot_core refine --model_dir MOE_DIR --video in.mp4 --prompt "..." --output out.mp4`` (every frame
through the refiner, at the source's frame rate) and
``python -m lingbot_core rewrite --prompt "..." --system_prompts rewriter/ --base_url URL ... --output p.json``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .model.size_presets import BUCKETS, RATIOS  # the reference runner's size buckets, one table with the nodes


def _window_flags(parser, frames_flag: str, overlap_flag: str, default_frames: int, off: str) -> None:
    from .sampling.context_windows import DEFAULT_OVERLAP

    parser.add_argument(frames_flag, type=int, default=default_frames,
                        help=f"context windows: the DiT sees the video as overlapping clips of this many frames (4n+1; {off})")
    parser.add_argument(overlap_flag, type=int, default=DEFAULT_OVERLAP,
                        help="frames neighbouring windows share (a multiple of 4)")


def _parallel_flags(parser) -> None:
    """The reference runner's multi-GPU flags (lingbot_core.parallel; run under torchrun, one process per device)."""
    parser.add_argument("--cfg_parallel_degree", type=int, default=1,
                        help="2 = the cond and uncond guidance branches on two ranks at once (about 2x faster)")
    parser.add_argument("--context_parallel_degree", type=int, default=1,
                        help="split the DiT's tokens over this many ranks (Ulysses; must divide the attention heads)")
    parser.add_argument("--enable_fsdp_inference", action="store_true",
                        help="shard the DiT's weights over all ranks (FSDP2; about 1/N of them per rank)")
    parser.add_argument("--enable_vlm_fsdp_inference", action="store_true",
                        help="shard the text encoder (Qwen3-VL) over all ranks too")


def _start_parallel(args):
    """This rank's ParallelContext when the flags or torchrun ask for several processes, else None."""
    import os

    from .parallel import ParallelPlan, init_distributed

    plan = ParallelPlan(cfg_degree=args.cfg_parallel_degree, context_degree=args.context_parallel_degree,
                        fsdp=args.enable_fsdp_inference, fsdp_text_encoder=args.enable_vlm_fsdp_inference)
    if plan.world_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    if args.device is not None:
        raise ValueError("--device does not combine with the parallel flags: each rank uses the device of its "
                         "LOCAL_RANK (cuda:LOCAL_RANK, or the CPU without CUDA).")
    return init_distributed(plan)


def _write_frames(frames, path, fps: float, image: bool = False) -> str:
    """``.npy``: the float32 frames (T, H, W, 3) in [0, 1] as they are (runs compare exactly); else mp4 (png for
    one image)."""
    import numpy as np

    from .files.video_io import write_png, write_video

    if str(path).endswith(".npy"):
        np.save(path, np.asarray(frames, dtype=np.float32))
        return str(path)
    if image:
        return str(write_png(frames[0], Path(path).with_suffix(".png")))
    return str(write_video(frames, path, fps=fps))


def _read_video(path):
    """(frames (T, H, W, 3) float32 in [0, 1], fps) of a local video file, within the pipeline's limits."""
    import torch

    from .files.video_io import read_video_file
    from .model.latents import MAX_FRAMES, MAX_SIDE

    data, fps = read_video_file(path, max_frames=MAX_FRAMES, max_side=MAX_SIDE)
    logging.info("video: %s, %d frames of %dx%d at %.3f fps", path, data.shape[0], data.shape[2], data.shape[1], fps)
    return torch.from_numpy(data).float().div_(255.0), fps


def _snapped(side: int) -> int:
    from .model.latents import SIZE_MULTIPLE

    return max(SIZE_MULTIPLE, side // SIZE_MULTIPLE * SIZE_MULTIPLE)


def build_parser() -> argparse.ArgumentParser:
    from .model.attention import ATTENTION_CHOICES
    from .model.latents import VAE_TILING_MODES
    from .loading import DIT_DTYPES
    from .model.lora import parse_lora_arg
    from .memory.offload import OFFLOAD_MODES
    from .sampling.context_windows import REFINER_CONTEXT_FRAMES
    from .sampling.scheduling import SAMPLERS, parse_sigmas

    parser = argparse.ArgumentParser(prog="python -m lingbot_core", description="LingBot-Video inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="text/image to video (or image), optionally refined")
    g.add_argument("--model_dir", default=None,
                   help="package root (with model_index.json); optional when the three files below are given")
    g.add_argument("--transformer_file", default=None,
                   help="the DiT as one file (.gguf or .safetensors, e.g. ComfyUI/models/diffusion_models/...)")
    g.add_argument("--text_encoder_file", default=None,
                   help="Qwen3-VL-4B as one .safetensors file (e.g. Comfy-Org's qwen3vl_4b_bf16.safetensors)")
    g.add_argument("--vae_file", default=None, help="the Wan 2.1 VAE as one .safetensors file (wan_2.1_vae.safetensors)")
    g.add_argument("--refiner_file", default=None, help="the refiner DiT as one file (with --run_refiner)")
    g.add_argument("--mode", choices=["t2i", "t2v", "ti2v"], default="t2v")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (a JSON caption string or plain text)")
    src.add_argument("--prompt_json", help="a rewriter prompt.json ({'caption': ..., 'duration': s}), or a list of parts, "
                     "a prompt per part of the video ([{'caption': ..., 'start_frame': 0}, ...]; without start_frame "
                     "spread evenly; needs --context_frames; --num_frames sets the length)")
    g.add_argument("--negative_prompt", default=None, help="negative text (default: the mode's default negative)")
    g.add_argument("--negative_prompt_json", default=None, help="a negative prompt JSON file (serialised compactly)")
    g.add_argument("--image", help="first frame for ti2v")
    g.add_argument("--resolution", choices=sorted(BUCKETS), help="size bucket (with --ratio)")
    g.add_argument("--ratio", default="9:16", choices=list(RATIOS), help="H:W ratio of the bucket")
    g.add_argument("--height", type=int, default=None)
    g.add_argument("--width", type=int, default=None)
    g.add_argument("--num_frames", type=int, default=9, help="4n+1 (a JSON duration overrides it)")
    g.add_argument("--steps", type=int, default=40)
    g.add_argument("--guidance_scale", type=float, default=3.0)
    g.add_argument("--shift", type=float, default=3.0)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--fps", type=int, default=24)
    g.add_argument("--output", default="output.mp4", help="mp4 path (png for t2i; .npy = the float32 frames)")
    g.add_argument("--offload", choices=list(OFFLOAD_MODES), default="none")
    g.add_argument("--blocks_on_gpu", type=int, default=0, help="DiT blocks kept on the GPU under --offload block")
    g.add_argument("--dit_precision", choices=list(DIT_DTYPES), default=None,
                   help="DiT weight dtype (default bf16 on CUDA, fp32 on CPU); fp8_* = fp8 storage, bf16 compute")
    g.add_argument("--device", default=None, help="e.g. cuda, cuda:1, cpu (default: best available)")
    g.add_argument("--attention", choices=list(ATTENTION_CHOICES), default="sdpa",
                   help="attention kernel: sdpa (reference), flash_attn (flash-attn package), sage (sageattention package)")
    g.add_argument("--compile_blocks", action="store_true", help="torch.compile each DiT block (the first step compiles)")
    g.add_argument("--no_cfg_lockstep", action="store_true",
                   help="run the CFG branches one full forward after the other (default: block by block, same frames)")
    g.add_argument("--step_cache", type=float, default=0.0,
                   help="step cache threshold (EasyCache rule; 0 = off, 0.05 default of the paper, ~0.1 = 2x fewer DiT runs)")
    g.add_argument("--lora", action="append", default=[], type=parse_lora_arg, metavar="PATH[:STRENGTH]",
                   help="a .safetensors LoRA for the base DiT (repeatable; strength 1 by default), e.g. the "
                        "four-step LoRA with --steps 4 --guidance_scale 1")
    g.add_argument("--sampler", choices=list(SAMPLERS), default="auto",
                   help="auto (the package's own: dmd_student for the DMD student, else unipc), unipc (reference), "
                        "euler (flow Euler, for distilled models) or dmd_student (the 8-step DMD student's sampler)")
    g.add_argument("--sigmas", default=None, type=parse_sigmas,
                   help="explicit decreasing sigma list replacing --steps/--shift, e.g. '1.0,0.9,0.75,0.5'")
    g.add_argument("--video", default=None,
                   help="video-to-video: an input video file (any length; its frame count, and with no --height/--width "
                        "its size rounded down to a multiple of 16, set the output's; written at its frame rate)")
    g.add_argument("--denoise", type=float, default=1.0,
                   help="video-to-video strength as in ComfyUI's KSampler: --steps steps run, the last ones of a "
                        "steps/denoise-step grid (1.0 = plain text-to-video; e.g. 0.5)")
    _window_flags(g, "--context_frames", "--context_overlap", 0, "0 = off")
    g.add_argument("--vae_tiling", choices=list(VAE_TILING_MODES), default="auto",
                   help="tiled VAE encode (--video) and decode with the refiner's 384x640 tiles: auto = above 720p "
                        "(more than 720x1280 pixels a frame; an untiled 1080p decode needs 30-40 GB of VRAM), on, off")
    g.add_argument("--run_refiner", action="store_true", help="refine the video with refiner/ (MoE package)")
    g.add_argument("--refiner_output", default=None, help="mp4 path of the refined video")
    g.add_argument("--refiner_height", type=int, default=1088)
    g.add_argument("--refiner_width", type=int, default=1920)
    g.add_argument("--refiner_steps", type=int, default=8)
    g.add_argument("--refiner_t_thresh", type=float, default=0.85)
    g.add_argument("--refiner_sigma_tail_steps", type=int, default=2)
    g.add_argument("--refiner_max_video_frames", type=int, default=None)
    g.add_argument("--refiner_lora", action="append", default=[], type=parse_lora_arg, metavar="PATH[:STRENGTH]",
                   help="a .safetensors LoRA for the refiner DiT (repeatable)")
    _window_flags(g, "--refiner_context_frames", "--refiner_context_overlap", REFINER_CONTEXT_FRAMES,
                  "the refiner's clip; 0 = the whole video as one clip")
    _parallel_flags(g)
    f = sub.add_parser("refine", help="a video file through the refiner (e.g. an upscale to 1080p): every frame in, mp4 out")
    f.add_argument("--model_dir", default=None, help="the MoE package root (its refiner/ is loaded)")
    f.add_argument("--refiner_file", default=None, help="the refiner DiT as one file (with --text_encoder_file and --vae_file)")
    f.add_argument("--text_encoder_file", default=None, help="Qwen3-VL-4B as one .safetensors file")
    f.add_argument("--vae_file", default=None, help="the Wan 2.1 VAE as one .safetensors file")
    f.add_argument("--video", required=True, help="the input video file (any length, size and frame rate)")
    fsrc = f.add_mutually_exclusive_group(required=True)
    fsrc.add_argument("--prompt", help="prompt text (a JSON caption string or plain text) describing the video")
    fsrc.add_argument("--prompt_json", help="a rewriter prompt.json")
    f.add_argument("--negative_prompt", default=None, help="negative text (default: the refiner's zeroed negative)")
    f.add_argument("--height", type=int, default=1088)
    f.add_argument("--width", type=int, default=1920)
    f.add_argument("--steps", type=int, default=8)
    f.add_argument("--guidance_scale", type=float, default=3.0)
    f.add_argument("--shift", type=float, default=3.0)
    f.add_argument("--t_thresh", type=float, default=0.85, help="noise level the refinement starts from (lower keeps more)")
    f.add_argument("--tail_steps", type=int, default=2)
    f.add_argument("--seed", type=int, default=42)
    f.add_argument("--no_vae_tiling", action="store_true", help="untiled VAE encode/decode (default: tiled, as the reference)")
    _window_flags(f, "--context_frames", "--context_overlap", REFINER_CONTEXT_FRAMES,
                  "the refiner's clip; 0 = the whole video as one clip")
    f.add_argument("--step_cache", type=float, default=0.0)
    f.add_argument("--offload", choices=list(OFFLOAD_MODES), default="none")
    f.add_argument("--blocks_on_gpu", type=int, default=0)
    f.add_argument("--dit_precision", choices=list(DIT_DTYPES), default=None)
    f.add_argument("--device", default=None)
    f.add_argument("--lora", action="append", default=[], type=parse_lora_arg, metavar="PATH[:STRENGTH]",
                   help="a .safetensors LoRA for the refiner DiT (repeatable)")
    f.add_argument("--output", default="refined.mp4",
                   help="mp4 path (written at the source's frame rate, at most 24; .npy = the float32 frames)")
    _parallel_flags(f)
    r = sub.add_parser("rewrite", help="prose -> structured JSON caption (prompt.json) through a chat server")
    r.add_argument("--prompt", required=True, help="the prose prompt")
    r.add_argument("--mode", choices=["t2v", "ti2v", "t2i"], default="t2v")
    r.add_argument("--duration", type=float, default=5.0, help="video seconds (rounded; ignored for t2i)")
    r.add_argument("--image", help="first frame for ti2v (sent in both steps)")
    r.add_argument("--system_prompts", required=True,
                   help="the release's rewriter prompt module (.py, read as data) or a folder of <NAME>.txt files")
    r.add_argument("--base_url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL")
    r.add_argument("--expand_model", required=True, help="step 1: the base VLM's name on the server")
    r.add_argument("--map_model", required=True, help="step 2: the base VLM with the rewriter LoRA, as the server names it")
    r.add_argument("--api_key_env", default="", help="name of the environment variable holding the API key (none if empty)")
    r.add_argument("--allow_http", action="store_true",
                   help="send the key over plain http to another machine (only on a network you trust)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--keep_thinking", action="store_true",
                   help="do not send chat_template_kwargs.enable_thinking=false (for servers that reject it)")
    r.add_argument("--output", default="prompt.json")
    c = sub.add_parser("convert-vae", help="write the package's VAE in the original Wan 2.1 layout (for ComfyUI's models/vae)")
    c.add_argument("--model_dir", required=True, help="package root (with model_index.json)")
    c.add_argument("--output", required=True, help="the .safetensors file to write, e.g. ComfyUI/models/vae/lingbot_wan2.1_vae.safetensors")
    return parser


def rewrite(args) -> int:
    from PIL import Image

    from .net.chat_client import ChatServer
    from .prompts.rewriter import load_system_prompts, rewrite as run_rewrite, save_prompt_file
    from .net.server_list import api_key_from_env

    server = ChatServer(args.base_url, api_key_from_env(args.api_key_env, where="--api_key_env"), args.timeout,
                        disable_thinking=not args.keep_thinking, allow_http=args.allow_http)
    image = Image.open(args.image).convert("RGB") if args.image else None
    result = run_rewrite(server, load_system_prompts(args.system_prompts), args.prompt, mode=args.mode,
                         duration=args.duration, image=image, expand_model=args.expand_model,
                         map_model=args.map_model, temperature=args.temperature, seed=args.seed)
    for warning in result.warnings:
        logging.warning("caption: %s", warning)
    print(save_prompt_file(result, args.output))
    return 0


def _prompt_schedule(text: str):
    """A prompt file holding a list of parts -> (prompts, starts or None) (lingbot_core.prompts.prompt_schedule); else None."""
    from .prompts.prompt_schedule import schedule_from_json

    stripped = text.lstrip("\ufeff").strip()
    if not stripped.startswith("["):
        return None
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        return None  # parse_prompt reports where the JSON is broken
    return schedule_from_json(data)


def _progress(desc: str):
    from tqdm.auto import tqdm

    bar = {}

    def callback(step, total, _x0):
        if "b" not in bar:
            bar["b"] = tqdm(total=total, desc=desc, unit="step")
        bar["b"].update(1)
        if step + 1 == total:
            bar.pop("b").close()

    def status(text):  # the step cache's counts, shown after the bar
        if "b" in bar:
            bar["b"].set_postfix_str(text, refresh=False)

    callback.status = status
    return callback


def generate(args) -> int:
    from PIL import Image

    from . import load_pipeline, parse_prompt
    from .parallel import parallelize
    from .prompts.text_conditioning import compact_json, frames_for_prompt, read_prompt_file
    from .model.refiner import refiner_output_fps

    # A prompt file and JSON prompt text go through the same parser: one compact serialisation of
    # the caption, and a validated duration.
    prompt = read_prompt_file(args.prompt_json) if args.prompt_json else args.prompt
    starts, schedule = None, _prompt_schedule(prompt) if args.prompt_json else None
    if schedule is not None:  # a list of parts: a prompt per part of the video (--num_frames sets its length)
        prompt, starts = schedule
        if args.run_refiner:
            raise SystemExit("error: --run_refiner takes one prompt, not a prompt schedule; refine the video with "
                             "`python -m lingbot_core refine --video ... --prompt ...`.")
    parsed = parse_prompt(prompt if schedule is None else prompt[0])
    for warning in parsed.warnings:
        logging.warning("prompt: %s", warning)
    negative = args.negative_prompt
    if args.negative_prompt_json:
        negative = compact_json(json.loads(read_prompt_file(args.negative_prompt_json)))
    video, fps = (None, float(args.fps)) if args.video is None else _read_video(args.video)
    if video is not None and args.mode == "t2i":
        raise SystemExit("error: --video needs --mode t2v (or ti2v), not t2i.")
    height, width = (192, 320) if args.resolution is None else BUCKETS[args.resolution][args.ratio]
    if video is not None and args.resolution is None:
        height, width = _snapped(video.shape[1]), _snapped(video.shape[2])  # the source's size
    height, width = args.height or height, args.width or width
    num_frames = 1 if args.mode == "t2i" else frames_for_prompt(parsed, args.num_frames, args.fps, schedule is None)
    if args.mode == "ti2v" and not args.image:
        raise SystemExit("--mode ti2v needs --image")
    image = Image.open(args.image).convert("RGB") if args.mode == "ti2v" else None

    dit = dict(blocks_on_gpu=args.blocks_on_gpu, dtypes={"transformer": args.dit_precision} if args.dit_precision else None,
               attention=args.attention, compile_blocks=args.compile_blocks, cfg_lockstep=not args.no_cfg_lockstep,
               text_encoder_file=args.text_encoder_file, vae_file=args.vae_file)
    if args.model_dir is None and not (args.transformer_file and args.text_encoder_file and args.vae_file):
        missing = [f"--{n}" for n in ("transformer_file", "text_encoder_file", "vae_file") if not getattr(args, n)]
        raise SystemExit(f"error: give --model_dir (a package folder), or the three files: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing.")
    if args.run_refiner and args.model_dir is None and not args.refiner_file:
        raise SystemExit("error: --run_refiner without --model_dir needs --refiner_file (the refiner DiT as one file).")
    ctx = _start_parallel(args)
    device, main = (args.device, True) if ctx is None else (ctx.device, ctx.is_main)
    pipe = load_pipeline(args.model_dir, offload=args.offload, device=device, loras=args.lora,
                         transformer_file=args.transformer_file, **dit)
    if ctx is not None:
        parallelize(pipe, ctx)
    frames = pipe.generate(prompt, negative_prompt=negative, image=image, height=height, width=width,
                           num_frames=num_frames, steps=args.steps, guidance_scale=args.guidance_scale,
                           shift=args.shift, seed=args.seed, callback=_progress("generate") if main else None,
                           step_cache=args.step_cache,
                           sampler=args.sampler, sigmas=args.sigmas, video=video, denoise=args.denoise,
                           context_frames=args.context_frames, context_overlap=args.context_overlap,
                           vae_tiling=args.vae_tiling, prompt_starts=starts)
    if main:  # every rank holds the frames; one writes them
        print(_write_frames(frames, args.output, fps, image=num_frames == 1 and video is None))
    if args.run_refiner and len(frames) > 1:
        pipe.release()  # the refiner pipeline needs its own components; free the base first
        refiner = load_pipeline(args.model_dir, transformer_subfolder="refiner", offload=args.offload, device=device,
                                loras=args.refiner_lora, transformer_file=args.refiner_file, **dit)
        if ctx is not None:
            parallelize(refiner, ctx)
        refined = refiner.refine(frames, prompt, first_frame=image, height=args.refiner_height, width=args.refiner_width,
                                 steps=args.refiner_steps, guidance_scale=args.guidance_scale, shift=args.shift,
                                 t_thresh=args.refiner_t_thresh, tail_steps=args.refiner_sigma_tail_steps,
                                 seed=args.seed, fps=fps, max_frames=args.refiner_max_video_frames,
                                 callback=_progress("refine") if main else None, step_cache=args.step_cache,
                                 context_frames=args.refiner_context_frames, context_overlap=args.refiner_context_overlap)
        suffix = Path(args.output).suffix if Path(args.output).suffix == ".npy" else ".mp4"
        path = args.refiner_output or str(Path(args.output).with_name(Path(args.output).stem + "_refined" + suffix))
        if main:
            print(_write_frames(refined, path, refiner_output_fps(fps)))
    return 0


def refine(args) -> int:
    from . import load_pipeline
    from .model.refiner import refiner_output_fps
    from .parallel import parallelize
    from .prompts.text_conditioning import read_prompt_file

    if args.model_dir is None and not (args.refiner_file and args.text_encoder_file and args.vae_file):
        missing = [f"--{n}" for n in ("refiner_file", "text_encoder_file", "vae_file") if not getattr(args, n)]
        raise SystemExit(f"error: give --model_dir (the MoE package), or the three files: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing.")
    prompt = read_prompt_file(args.prompt_json) if args.prompt_json else args.prompt
    video, fps = _read_video(args.video)
    ctx = _start_parallel(args)
    device, main = (args.device, True) if ctx is None else (ctx.device, ctx.is_main)
    pipe = load_pipeline(args.model_dir, transformer_subfolder="refiner", offload=args.offload, device=device,
                         loras=args.lora, transformer_file=args.refiner_file, blocks_on_gpu=args.blocks_on_gpu,
                         dtypes={"transformer": args.dit_precision} if args.dit_precision else None,
                         text_encoder_file=args.text_encoder_file, vae_file=args.vae_file)
    if ctx is not None:
        parallelize(pipe, ctx)
    refined = pipe.refine(video, prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                          steps=args.steps, guidance_scale=args.guidance_scale, shift=args.shift, t_thresh=args.t_thresh,
                          tail_steps=args.tail_steps, seed=args.seed, fps=fps, vae_tiling=not args.no_vae_tiling,
                          callback=_progress("refine") if main else None, step_cache=args.step_cache,
                          context_frames=args.context_frames, context_overlap=args.context_overlap)
    if main:
        print(_write_frames(refined, args.output, refiner_output_fps(fps)))
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    from .net.chat_client import ChatServerError

    try:
        if args.command == "convert-vae":
            from .files.vae_layout import write_original_wan21

            print(write_original_wan21(args.model_dir, args.output))
            return 0
        if args.command == "refine":
            return refine(args)
        return rewrite(args) if args.command == "rewrite" else generate(args)
    except (ValueError, FileNotFoundError, ChatServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.command in ("generate", "refine"):
            from .parallel import shutdown

            shutdown()  # a parallel run's process group (no-op otherwise)
