"""The max attention logit on its way to Megatron's log without a host sync per step
(``hooks._wrap_clip_qk`` returns a device tensor; ``hooks._max_logit_read`` reads it to the host
only on the iterations ``training_log`` writes it)."""

from __future__ import annotations

import torch

from megatron_muon.megatron.hooks import _MAX_LOGIT_ARG, _max_logit_read


def _training_log_args(value) -> tuple:
    # training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
    #              skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit)
    return ({}, {}, 1e-3, 4, 1.0, False, 0, 1.0, None, None, value)


def test_the_position_is_training_logs():
    import inspect

    from megatron.training.training import training_log

    assert list(inspect.signature(training_log).parameters)[_MAX_LOGIT_ARG] == "max_attention_logit"


def test_read_on_log_iterations_only():
    logit = torch.tensor(12.5)
    args, kwargs = _max_logit_read(_training_log_args(logit), {}, on_log_iteration=True)
    assert args[_MAX_LOGIT_ARG] == 12.5 and type(args[_MAX_LOGIT_ARG]) is float and args[:_MAX_LOGIT_ARG] == \
        _training_log_args(logit)[:_MAX_LOGIT_ARG]
    args, _ = _max_logit_read(_training_log_args(logit), {}, on_log_iteration=False)
    assert args[_MAX_LOGIT_ARG] == 0.0  # never written on this iteration: nothing read
    _, kwargs = _max_logit_read((), {"max_attention_logit": logit}, on_log_iteration=True)
    assert kwargs == {"max_attention_logit": 12.5}
    plain = _training_log_args(0.0)  # upstream's float (the plugin inactive): untouched
    assert _max_logit_read(plain, {}, on_log_iteration=True) == (plain, {})
