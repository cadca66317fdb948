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
dropped or rejected by the engine anyway): the probe then has no verdict for that batch.

**When it runs.** A forward pre-hook on the root module computes an *input signature* (training
flag, shapes with the batch size replaced by -1, dtypes and devices of the tensor arguments, the
values of bool/str/None arguments and the types of other ones) — attribute reads only, no tensor
op. For a signature still to be probed (with grad enabled), every floating tensor argument whose
size along the batch dimension is the batch size (the size of the first tensor argument there)
and that does not require grad is replaced by ``leaf.clone()`` with ``leaf = x.detach()
.requires_grad_()`` (a non-leaf copy, so the model may still change it in place), and the probe
is *pending*. :meth:`SeparabilityProbe.check` (per-sample losses) or
:meth:`SeparabilityProbe.check_outputs` (a random cotangent on the model's outputs) then runs
the comparison and counts one probe of the signature; after ``probed_steps`` probes (K, default
1) the signature is accepted (an LRU of 256 signatures, so models with changing shapes are probed
per shape without unbounded memory), and nothing runs afterwards while it stays the same.

**Which batches are probed** is a function of the sequence of input signatures alone: the first K
checked non-empty batches of each, counted whatever came out of them. The passes are seen by the
model's tensor hooks, so a schedule that followed the verdict would let one sample tell the model
code about itself: a sample whose gradient is not finite (which the engine drops, releasing the
rest), or one that zeroes every other sample's gradient, leaves its batch without a verdict, and
a re-probe of the next batch would run two passes more than the batch without the sample does. A
batch of one sample (which cannot show mixing) runs the same passes, so neither does the batch
size decide which batches are probed (an empty batch runs nothing and is not counted: the engine
takes no backward of it either). A mixing verdict raises, and the signature stays to be probed.
When none of the K probes of a signature had a verdict, a ``RuntimeWarning`` names the points
not compared and the signature is accepted: a crafted sample in the first batch of a signature
can hide mixing from the probe (K > 1 makes it need all K batches); the batch flow refuses mixing
in the forward at every step whatever the values, and mixing only in the backward is then not
ruled out. Cost: 2·K extra backward passes per signature (3·K when float16 is involved).

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
  which pending forward a loss came from: a forward that never reaches a loss (an evaluation
  forward with grad enabled) is then marked probed together with the next checked one.
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
  schedule (the first K checked batches of each signature), the accepted signatures (an LRU) and
  the checks;
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
