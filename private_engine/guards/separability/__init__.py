"""Sample-separability probe: a numerical check, by autograd, that no op mixes samples.

Per-sample clipping bounds one sample's influence on the release by R only when the model is
*sample-separable*: row j of every recorded batch-first tensor (dim 0; k consecutive rows per
sample when a tensor has k·B rows, e.g. Swin windows) depends on sample j's data alone, and entry
j of the loss vector is sample j's loss. An op that mixes rows (``h - h.mean(0)``, ``h.flip(0)``,
``softmax(h, dim=0)``, a Linear on a sequence-first ``(T, B, d)`` tensor, a loss out of batch
order) lets one sample move the release by several times R, silently.

**The test.** The backward pass is linear in the loss cotangent, so the gradient at a recorded
tensor ``t`` of ``Σ_j r_j·L_j`` is ``Σ_j r_j·∂L_j/∂t``. When the model is separable,
``∂L_j/∂t`` is zero outside sample j's rows, hence for every row m of t::

    ∂(Σ_j r_j·L_j)/∂t [m]  =  r_{m // k} · ∂(Σ_j L_j)/∂t [m]      (k = rows of t / B)

With ``r_j = 2^{e_j}`` the two sides are equal *exactly* in IEEE arithmetic: multiplying every
cotangent of sample j by a power of two multiplies every product and partial sum that the
backward forms for sample j's rows by the same power of two, without a new rounding (barring
overflow and subnormals). An op that mixes rows makes row m a combination ``Σ_j r_j·G_j[m]`` of
several samples' weights, which differs from ``r_{m//k}·Σ_j G_j[m]`` unless the weights agree.
The exponents ``e_j`` are a random arrangement of ``lo + (j mod E)`` (E = 16 levels, h-15..h with
h ≤ 15; 5 levels, -4..0, when float16 is involved), so up to E samples get distinct weights and
any mixing among them is seen; with more samples, mixing only among samples of equal weight goes
unseen, with small probability, and a re-probe draws new weights.

Two backward passes (``torch.autograd.grad(..., retain_graph=True)``) give both sides at every
recorded output (the engine's ``RecordedCall.edge``, the tracer's ``entry_edges()``, the
fallback's ``out_edges()``) and at the model's float inputs. Rows are compared through per-row
fingerprints (the row's norm and its projection on a random vector, in float64), so only one
pass's gradients are alive at a time. A row fails when a fingerprint differs by more than a
relative tolerance set by the lowest precision in the graph: 1e-5 for float32/64, 2e-2 for
float16 (and float32 on CUDA with TF32 allowed), 5e-2 for bfloat16. Exactness holds op by op,
but a non-deterministic kernel (or CPU flash attention in float16) perturbs a value by one
rounding, which a later low-precision op can turn into a flip of its last bit; mixing changes
rows by a factor of the weights' ratios (≥ 2), far above these tolerances.

The passes are a fixed sequence, the same for every batch: tensor hooks of the model run at every
backward pass, so a number of passes that followed the data (a retry when a pass overflows) would
let one sample change what model code sees, and through its side effects what the other samples
release. Float32, bfloat16 and float64 run the two passes; the largest exponent ``h`` is 15
unless the plain pass's largest compared entry times ``2^h`` would come within ``2^8`` of the
dtype's largest value (compared gradients above 2^104, about 2e31, in float32), and is lowered
to keep that margin.
Float16 also loses exactness in its subnormal range, so when it is involved a third pass, between
the two, repeats the plain one scaled by a common ``2^s`` (as a GradScaler would: the largest
compared entry near 2^11 and the largest gradient that entered any node of the graph in the plain
pass at most 2^14, which the plain pass notes with one reduction per node), and the weights only
scale down; the scaled pass is the baseline unless it overflowed where the plain one did not.
Rows that are not finite in the baseline or the weighted pass are not compared (such samples are
dropped by the engine anyway); a batch is judged on the others: a point has a verdict when at
least two samples' rows there are finite in both passes and not zero.

**When it runs.** A forward pre-hook on the root module computes an *input signature* (training
flag, shapes with the batch size replaced by -1, dtypes and devices of the tensor arguments, the
values of bool/str/None arguments and the types of other ones) — attribute reads only, no tensor
op — and counts the forwards (with grad enabled) of every signature. The n-th forward of a
signature is probed when ``n ≤ K`` (``probed_steps``, default 1) or ``n`` is a power of two from 4
on (4, 8, 16, …): every floating tensor argument whose size along the batch dimension is the batch
size (the size of the first tensor argument there) and that does not require grad is replaced by
``leaf.clone()`` with ``leaf = x.detach().requires_grad_()`` (a non-leaf copy, so the model may
still change it in place), and the probe is *pending*. :meth:`SeparabilityProbe.check`
(per-sample losses) or :meth:`SeparabilityProbe.check_outputs` (a random cotangent on the model's
outputs) then runs the comparison. Other forwards run untouched. The counts are kept for 256
signatures (an LRU: a signature seen again after that starts its schedule over).

**Which batches are probed** is a function of the sequence of input signatures alone, never of a
verdict, a value or the batch size: the passes are seen by the model's tensor hooks, so a schedule
that followed what the probe found would let one sample tell the model code about itself (a
sample whose gradient is not finite, which the engine drops, would make the next batch run two
passes more than the batch without it does). A batch of one sample runs the same passes, and an
empty batch counts as a forward (it runs no pass: the engine takes no backward of it either). A
mixing verdict raises, and the signature's next forward is probed too. The schedule lasts: a
model whose backward starts to mix at its t-th forward is refused by its 2t-th (at most), and a
crafted sample in one probed batch (one whose gradient is not finite and is averaged into every
row leaves nothing to compare below the mix) hides the mixing from that batch only. Cost, per
signature: ``K + ⌊log2 N⌋ - 1`` probes over N ≥ 4 forwards with K ≤ 3, each of two backward
passes (three when float16 is involved): 13 probes, 26 backward passes, over 10,000 forwards with
K = 1. K = 1 is the default: forward 1 catches a model that mixes from the start, and 4, 8, 16, …
one that changes later; a larger K only probes more of the first forwards.

**What the probe found** is not private (it follows the batches' values, like the engine's
dropped-sample count): :attr:`SeparabilityProbe.records` holds, per signature, the probes run,
those with a verdict at every point and the points without one, and a probe without a verdict
writes a DEBUG log record; neither a warning nor an INFO record follows from one batch. A
structural limit — points where fewer than two samples are compared at each of the signature's
first three probes (a gradient that reaches one sample by construction, batches of one sample) —
is told in one ``RuntimeWarning``. A sample whose gradient is not finite is never compared, so it
changes neither; one with a finite gradient changes only its own row in a separable model, so it
changes the warning only when it is in all three batches and is each time the second sample that
reaches the point.

The signature holds the shapes other than the batch size (all of them when the batch dimension is
not known): the engine treats a batch's shapes as public, as the batch flow (which tags shapes as
depending on no sample) and the layer plan (chosen per batch from the shapes; in the two-pass
modes it decides whether the second backward runs) do, and the model's own forward receives them.
Padding each batch to its longest sample makes one sample's length a shape — a new length is a
new signature, probed at its first batch —, so pad to a fixed length when lengths are private.

**When it fails** a diagnostic pass (cost irrelevant) hooks every autograd node between the loss
and the offending tensor, repeats both passes with per-node fingerprints, and names the node(s)
whose incoming gradients are still per-sample but whose outgoing ones are not ("mean over dim 0
(MeanBackward1)"). :class:`BatchMixingError` names the layer, the op and what to change.

Limits:

* Mixing is seen only where gradients flow. Integer inputs (token ids) cannot be made
  differentiable: mixing done on them before the first recorded layer (``ids.flip(0)`` or
  ``ids[perm]`` ahead of the Embedding) is not seen. Likewise mixing through detached values
  (``h * h.detach().mean(0)``), through non-float data, or through model state (buffers
  updated in the forward) is invisible to autograd.
* Models whose forward has no float per-sample input (token ids only) cannot tell the probe
  which pending forward a loss came from: a probed forward that never reaches a loss (an
  evaluation forward with grad enabled) is recorded together with the next checked one.
* A probed forward that never reaches a check (an evaluation forward with grad enabled whose
  output is not backpropagated) uses up its place in the schedule: the signature's next probe
  is at its next scheduled forward.
* :meth:`SeparabilityProbe.check_outputs` starts from the model's outputs: mixing inside the
  user's loss function (``loss.flip(0)``) and auxiliary outputs that are not per-sample (a
  scalar load-balancing loss) are not seen there.
* A float tensor argument whose size along the batch dimension equals the batch size is taken as
  per-sample data (as the engine's tracer does): a constant shared by all samples that happens to
  have that size (a ``(T, T)`` float attention mask with T = B) is reported as mixed.
* Tensor hooks that the user registered on intermediate tensors run during the probe's backward
  passes (the engine's own recording hooks are switched off by the engine around the probe).

The package's parts:

* :mod:`.probe` — :class:`SeparabilityProbe`: the root pre-hook, the pending forwards, the
  schedule (:func:`~.probe.probed_at`: forwards 1..K, 4, 8, 16, … of each signature), the
  records (:class:`~.probe.ProbeRecord`, an LRU) and the checks;
* :mod:`.inputs` — the input signature, the batch size, the differentiable copies of the
  model's per-sample inputs (a :class:`~.inputs.PendingForward` each);
* :mod:`.graph` — the comparison points (recorded outputs, model inputs) and walks of the
  autograd graph;
* :mod:`.fingerprints` — per-row fingerprints of a gradient and the row comparison;
* :mod:`.comparison` — the two weighted backward passes and their verdict at every point;
* :mod:`.diagnosis` — naming the op(s) that mix rows, and :class:`BatchMixingError`.
"""
from .diagnosis import BatchMixingError, describe_node
from .fingerprints import DEFAULT_TOLERANCE, TOLERANCES
from .probe import (
    MAX_PENDING,
    MAX_SIGNATURES,
    PROBED_STEPS,
    STRUCTURAL_PROBES,
    ProbeRecord,
    SeparabilityProbe,
    probed_at,
)

__all__ = ["BatchMixingError", "DEFAULT_TOLERANCE", "MAX_PENDING", "MAX_SIGNATURES",
           "PROBED_STEPS", "ProbeRecord", "STRUCTURAL_PROBES", "SeparabilityProbe", "TOLERANCES",
           "describe_node", "probed_at"]
