"""What early stopping reads from the eval history (train/trainer.py Progress.note_eval)."""

from trainpod.train.trainer import Progress


def test_a_diverged_first_eval_never_becomes_the_best_that_later_evals_cannot_beat():
    """A NaN first eval (bf16 overflow at the start of a run) stayed the best score for good: no later eval
    compares below NaN, so each counted as no improvement and early stopping ended a run that had recovered."""
    history = Progress()
    history.note_eval(10, float("nan"), float("nan"), min_delta=0.0)
    for step, loss in ((20, 3.0), (30, 2.5), (40, 2.0)):
        history.note_eval(step, loss, loss, min_delta=0.0)
    assert history.best_score == 2.0 and history.best_eval_loss == 2.0
    assert history.evals_without_improvement == 0


def test_a_diverged_eval_after_good_ones_counts_as_no_improvement_and_keeps_the_best():
    history = Progress()
    history.note_eval(10, 2.0, 2.0, min_delta=0.0)
    history.note_eval(20, float("inf"), float("inf"), min_delta=0.0)
    history.note_eval(30, float("nan"), float("nan"), min_delta=0.0)
    assert history.best_score == 2.0 and history.best_eval_loss == 2.0
    assert history.evals_without_improvement == 2
    assert history.last_eval_step == 30


def test_an_eval_without_the_ranked_metric_leaves_the_plateau_count_alone():
    """A generation metric measured every k-th eval: the evals between have a loss and no score."""
    history = Progress()
    history.note_eval(10, 2.0, 0.30, min_delta=0.0)
    history.note_eval(20, 1.9, None, min_delta=0.0)
    assert history.best_score == 0.30 and history.evals_without_improvement == 0
    assert history.last_score_step == 10 and history.best_eval_loss == 1.9
