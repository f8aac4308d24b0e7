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


def _muon(period=None):
    """A real one-process optimizer (one 4x4 Muon matrix), for the decisions below."""
    from megatron_muon.config import MuonConfig
    from megatron_muon.optimizer import MuonWithAdamW

    return MuonWithAdamW([dict(params=[torch.nn.Parameter(torch.zeros(4, 4))], algorithm="muon")],
                         config=MuonConfig(muonbp_period=period))


def _args(**kw):
    from types import SimpleNamespace

    base = dict(log_interval=10, muon_log_stats=True, tensorboard_dir=None, wandb_project=None,
                tensorboard_log_interval=1, iterations_to_skip=[])
    return SimpleNamespace(**{**base, **kw})


def _recording_steps(margs, inner, last: int = 30) -> list[int]:
    """The iterations whose step records its norms, as the training_log hook decides them (after
    each iteration's log, for the next step)."""
    from megatron_muon.megatron.log_stats import plan_first_step, plan_next_step

    plan_first_step([inner], margs)
    recording = []
    for iteration in range(1, last + 1):
        if iteration not in margs.iterations_to_skip:
            recording += [iteration] if inner.record_norms else []
            plan_next_step([inner], margs, iteration)
    return recording


def test_norms_are_computed_for_the_iterations_that_read_them():
    from megatron_muon.megatron.log_stats import reads_norms

    margs = _args()
    assert [i for i in range(1, 31) if reads_norms(margs, i, first=i == 1)] == [1, 10, 20, 30]
    assert _recording_steps(margs, _muon()) == [1, 10, 20, 30]
    # MuonBP P=3: the three steps up to each log (a step of each kind)
    assert _recording_steps(margs, _muon(period=3)) == [1, 8, 9, 10, 18, 19, 20, 28, 29, 30]
    # a skipped iteration runs no step: the window counts the steps that run
    assert _recording_steps(_args(iterations_to_skip=[9]), _muon(period=3)) == [1, 7, 8, 10, 18, 19, 20, 28, 29, 30]
    # TensorBoard / W&B read them every --tensorboard-log-interval, with or without --muon-log-stats
    assert _recording_steps(_args(muon_log_stats=False, tensorboard_dir="tb", tensorboard_log_interval=15),
                            _muon()) == [1, 15, 30]
    assert _recording_steps(_args(muon_log_stats=False), _muon()) == []  # nothing reads them: never


def test_a_step_that_does_not_record_leaves_the_last_norms():
    inner = _muon()
    (param,) = inner.param_groups[0]["params"]
    param.grad = torch.ones(4, 4)
    inner.step()
    recorded = inner.step_norms["muon"].clone()
    inner.record_norms = False
    inner.step()
    assert torch.equal(inner.step_norms["muon"], recorded)  # no new norms: the last recording step's
    inner.record_norms = True
    inner.step()
    assert not torch.equal(inner.step_norms["muon"], recorded)
