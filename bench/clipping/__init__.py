"""Seconds per step, peak memory and maximum batch size of non-private training, private_engine
and Opacus, in one run.

Run it as ``python bench/bench_clipping.py`` (``--help`` lists the options). Every method trains
the same model (same initialisation, all parameters trainable unless its name ends in
``_frozen``) on the same random batch with SGD and cross-entropy. One step is forward +
per-sample clipping + noise + optimizer step (forward + backward + step for non-private
training)::

    nondp                plain training (the reference for every ratio)
    mixed                private_engine, clipping_mode="mixed" (ghost or instantiate per layer;
                         norm pass + 2nd backward)
    ghost                private_engine, clipping_mode="ghost"
    per_sample           private_engine, clipping_mode="per_sample"
    bk                   private_engine, clipping_mode="bk" (book-keeping, one backward; ghost
                         norm wherever possible)
    bk_mixed             private_engine, clipping_mode="bk_mixed" (book-keeping; seed 002's
                         memory rule per layer)
    bk_mixopt            private_engine, clipping_mode="bk_mixopt" (book-keeping; time-priority
                         rule per layer)
    opacus_hooks         Opacus make_private(grad_sample_mode="hooks")  (per-sample gradients)
    opacus_ghost         Opacus make_private(grad_sample_mode="ghost")  (ghost clipping)
    dropin_hooks         the Opacus loop of opacus_hooks with
                         ``from private_engine.opacus_compat import PrivacyEngine``
    dropin_ghost         the Opacus loop of opacus_ghost, likewise
    mixed_frozen         mixed, with the --frozen-set parameters (ViT cls_token, pos_embed, …)
                         frozen
    bk_mixed_frozen      bk_mixed, likewise
    opacus_hooks_frozen  opacus_hooks, likewise
    opacus_ghost_frozen  opacus_ghost, likewise
    dropin_*_frozen      dropin_*, likewise (the Opacus-compatible API refuses parameters that
                         need the tracer)

``--methods`` defaults to the core set (nondp, our six modes, opacus_hooks, opacus_ghost) on both
devices (``DEFAULT_METHODS``); ``--methods all`` (or ``core``) selects them by name. A method that
cannot run the model (e.g. an engine without that clipping mode, or Opacus on parameters owned by
the model's root module) shows its error text in the table.

Models (``--models``; random initialisation, nothing downloaded): any timm or torchvision name
(``vgg11`` is torchvision's, without BatchNorm), and ``text_transformer``, built here: token +
learned position embeddings (two ``nn.Embedding``), 4 timm ViT blocks of width 256, LayerNorm,
mean pooling and a linear head, on random token ids of shape (batch, ``--seq-len``). The default
is ViT-Tiny on CPU and ``CUDA_MODELS`` (ViT-Tiny/-Small/-Base, ResNet-18/-50, VGG-11, the text
model) on CUDA. BatchNorm is replaced by GroupNorm (``private_engine.fix_batchnorm``) for every
method.

``--amp bf16|fp16`` runs every method's forward under ``torch.autocast``; with fp16 non-DP
training and Opacus use a ``torch.amp.GradScaler`` and private_engine gets ``grad_scaler=``
(``--dtype`` instead casts the weights themselves).

Each method runs in its own subprocess (``--only METHOD``, driven step by step over a pipe), so
peak memory is not polluted by the other methods and every method starts from the same state.
On CPU the steps are interleaved by default (one step of each method per round), so changing
background load hits every method alike. Time is the median over the timed steps
(``time.perf_counter``, with ``torch.cuda.synchronize`` on CUDA), warm-up steps excluded. Peak
memory is the increase during the steps over what the process holds once the model, batch and
optimizer are built: ``torch.cuda.max_memory_allocated`` on CUDA, the peak resident set size
(VmHWM, reset through /proc/self/clear_refs; ``ru_maxrss`` otherwise) on CPU.

``--max-batch`` (CUDA only) then finds, for each method in a fresh subprocess, the largest batch
for which a full training step (two, to catch lazily allocated state) runs without running out
of GPU memory (``probe_max_batch``): the batch doubles from ``--batch-size`` until a step fails
(at most ``--max-batch-cap``), then bisection between the last size that fitted and the first
that did not (``max_batch_by_bisection``).

The project's speed targets are reported as met or not for each of our methods: ≤ 1.15× non-DP
time per step (set for ViT-Tiny, batch 16, on CPU; on CUDA too), and on CUDA ≤ 1.10× non-DP peak
memory and a maximum batch ≥ 0.9× non-DP's. ``--plot PATH`` draws time and memory × non-DP per
method (one panel per model); with ``--markdown`` the figure defaults to
``benchmarks_<device>.png`` next to the markdown file, which links it.

Examples::

    python bench/bench_clipping.py                          # ViT-Tiny, 224², batch 16, core methods
    python bench/bench_clipping.py --device cuda --amp bf16 --max-batch  # the seven CUDA models
    python bench/bench_clipping.py --model text_transformer --seq-len 256 \\
        --methods nondp bk_mixed opacus_hooks
    python bench/bench_clipping.py --model resnet18 --img-size 64 --methods all \\
        --plot /tmp/resnet18.png
    python bench/bench_clipping.py --methods nondp mixed opacus_ghost --markdown docs/benchmarks.md

Modules, one job each (the parent process runs every method in a child process of its own):

    config.py    the names: methods and method sets, default models, targets, the pipe's tag
    cli.py       the command line: arguments, and the child's command line built from them
    models.py    the model (timm, torchvision or the text model), frozen parameters, the batch
    methods.py   the methods: non-private, private_engine's modes, Opacus' flows, the drop-in
    measure.py   child side: memory meter, the step-by-step protocol over the pipe
    maxbatch.py  child side: the largest batch that fits in GPU memory (``--max-batch``)
    schedule.py  parent side: the children, interleaved or sequential, or one process
    tables.py    rows of the results and versus-Opacus tables, the target lines, text/markdown
    report.py    the text around the tables: machine, setup lines, markdown section and file
    plot.py      the figure (time and memory × non-DP per method)
    run.py       main(): every model in turn, printed and written
"""
