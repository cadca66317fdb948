"""torch's recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) and their exact replacement by
Opacus' ``DPRNN``, ``DPLSTM``, ``DPGRU``.

torch runs a whole recurrent layer as one fused op (``lstm``, ``gru``, ``rnn_tanh``; oneDNN or
cuDNN kernels), whose hidden states have the batch in dim 1 and whose weights are reached by no
layer call the hooks can record, so their per-sample gradients cannot be taken from the layer's
input and output: such a model is refused before training (:func:`check_no_recurrent`), naming
the modules and the fix.

The fix, :func:`fix_recurrent`, swaps each for Opacus' implementation of the same recurrence
(the same parameter names and values, ``state_dict`` entries under torch's keys, the same outputs
up to rounding), whose gate
pre-activations are computed by one Linear layer per weight matrix and direction, called once per
time step: ``z_t = W_ih x_t + b_ih + W_hh h_{t−1} + b_hh``. The Linear rule then clips these
layers exactly, all T calls of a layer together, so sample i's gradient of ``W_ih`` is

    ∂L_i/∂W_ih = Σ_t δ_{i,t} x_{i,t}ᵀ,     δ_{i,t} = ∂L_i/∂z_{i,t}

(back-propagation through time), and of ``W_hh`` the same with ``h_{i,t−1}`` in place of
``x_{i,t}`` — ghost-normed as ``⟨X_i X_iᵀ, Δ_i Δ_iᵀ⟩`` over the stacked time steps, or
instantiated, by the mode's rule.
"""
from __future__ import annotations

from typing import List

from torch import nn

#: torch's recurrent layers, each with its Opacus replacement (by name: imported when used)
TORCH_RECURRENT = {nn.LSTM: "DPLSTM", nn.GRU: "DPGRU", nn.RNN: "DPRNN"}


def recurrent_modules(model: nn.Module) -> List[str]:
    """Names of the ``nn.RNN``/``nn.LSTM``/``nn.GRU`` modules (subclasses included) of ``model``
    that have a trainable parameter."""
    return [name or type(model).__name__ for name, m in model.named_modules()
            if isinstance(m, tuple(TORCH_RECURRENT)) and
            any(p.requires_grad for p in m.parameters())]


def check_no_recurrent(model: nn.Module) -> None:
    """Refuse trainable ``nn.RNN``/``nn.LSTM``/``nn.GRU`` layers, naming them and the fix."""
    found = recurrent_modules(model)
    if found:
        shown = ", ".join(found[:8]) + (f", … ({len(found)} in all)" if len(found) > 8 else "")
        raise ValueError(
            f"the model has torch recurrent layers ({shown}). torch runs each as one fused op "
            "over the whole sequence, so their per-sample gradients cannot be recorded. Replace "
            "them by Opacus' DPLSTM / DPGRU / DPRNN — the same recurrence as Linear cells, "
            "clipped exactly, with the same parameters: model = "
            "private_engine.fix_recurrent(model).")


def fix_recurrent(model: nn.Module) -> nn.Module:
    """Replace every ``nn.LSTM``/``nn.GRU``/``nn.RNN`` of ``model`` (in place; the replacement is
    returned when ``model`` itself is one) by Opacus' ``DPLSTM``/``DPGRU``/``DPRNN`` with the same
    hyper-parameters (layers, bias, ``batch_first``, dropout, bidirectional, the RNN's
    nonlinearity) and the very same parameter tensors (values, device, dtype, ``requires_grad``),
    so an optimizer built before keeps working; returns the model. ``nn.LSTM(proj_size > 0)`` has
    no replacement and raises."""
    if isinstance(model, tuple(TORCH_RECURRENT)):
        return _replacement(model)
    for name, child in list(model.named_children()):
        if isinstance(child, tuple(TORCH_RECURRENT)):
            setattr(model, name, _replacement(child))
        else:
            fix_recurrent(child)
    return model


def _replacement(module: nn.RNNBase) -> nn.Module:
    """The Opacus layer computing what ``module`` computes, with its weights."""
    from opacus import layers as dp_layers

    if getattr(module, "proj_size", 0):
        raise ValueError(
            f"{type(module).__name__}(proj_size={module.proj_size}) has no exact per-sample "
            "replacement (Opacus' DPLSTM has no projection); use proj_size=0 and a Linear after "
            "the layer.")
    cls = next(getattr(dp_layers, dp) for t, dp in TORCH_RECURRENT.items() if isinstance(module, t))
    kwargs = dict(num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
                  dropout=module.dropout, bidirectional=module.bidirectional)
    if isinstance(module, nn.RNN):
        kwargs["nonlinearity"] = module.nonlinearity
    new = cls(module.input_size, module.hidden_size, **kwargs)
    # the very parameter tensors of ``module``, in the cells and under torch's names
    for name, p in module.named_parameters():
        owner, attr = new.new_to_old[name].rsplit(".", 1)
        setattr(new.get_submodule(owner), attr, p)
        new.register_parameter(name, p)
    new.train(module.training)
    return new
