"""Every recovery decision the leader makes, as pure functions of (state, now): no etcd, no
gRPC, no clocks. The rest of the coordinator gathers the state, calls these, and carries out
what they return.

Only the failed role is recovered; the living ones are left alone:

  rollout lost or hung      fence it, re-lease its open groups, ask for a replacement rollout
  trainer lost, hung,       fence every trainer rank of the job, restore from the last per-step
  stuck in a collective     checkpoint on a standby (or new) trainer; rollouts re-send what the
  or stopped on an error    trainer had not committed. An error that comes back at the same step
                            on the replacement is the job's, not a machine's: the job fails
                            (`trainer_error_verdict`)
  NaN/Inf                   roll back to the last good checkpoint and skip the batch; the same
                            rank again (others clean) marks its machine suspect: replace it
  degraded                  nothing (a warning for people)
  coordinator               nothing here: the standby replica wins the election and reloads

`recovery.mode: full_restart` answers every failure with a restart of every role from the last
checkpoint: the comparison baseline, never the default.

  incidents.py    the actions for an incident (`decide`), the facts it is decided on, and the
                  losses no monitor reported (`unreported_losses`)
  verdicts.py     when the job fails instead of recovering: poison groups, a trainer's error
                  that comes back, a rollout's error
  replacement.py  who is bound: the members a job starts on, which free member replaces a lost
                  one, which standbys are prepared, how many replacements are asked for

The executor (executor.py) carries out `decide`'s actions; binding.py, supervision.py and
work_service.py carry out the rest.
"""

from services.coordinator.policy.incidents import (
    FAILURES,
    NAN_SUSPECT_REPEATS,
    Action,
    Do,
    IncidentFacts,
    JobFacts,
    UnreportedLoss,
    decide,
    facts,
    incident_facts,
    leader_subject,
    missing_members,
    serving_epochs,
    unreported_losses,
)
from services.coordinator.policy.replacement import (
    ASKED_FOR_S,
    Filled,
    Start,
    Step,
    asks_due,
    bindable,
    filled,
    free_members,
    group_ranks,
    is_prepared_standby,
    is_standby,
    prepared_standbys,
    replacement_epoch,
    replacement_order,
    replacement_step,
    roles_missing,
    standbys_to_prepare,
    start_members,
)
from services.coordinator.policy.verdicts import (
    ErrorVerdict,
    leased_alone,
    poison_group,
    poison_verdict,
    rollout_error_verdict,
    trainer_error_recovered,
    trainer_error_verdict,
)

__all__ = [
    "ASKED_FOR_S",
    "FAILURES",
    "NAN_SUSPECT_REPEATS",
    "Action",
    "Do",
    "ErrorVerdict",
    "Filled",
    "IncidentFacts",
    "JobFacts",
    "Start",
    "Step",
    "UnreportedLoss",
    "asks_due",
    "bindable",
    "decide",
    "facts",
    "filled",
    "free_members",
    "group_ranks",
    "incident_facts",
    "is_prepared_standby",
    "is_standby",
    "leader_subject",
    "leased_alone",
    "missing_members",
    "poison_group",
    "poison_verdict",
    "prepared_standbys",
    "replacement_epoch",
    "replacement_order",
    "replacement_step",
    "roles_missing",
    "rollout_error_verdict",
    "serving_epochs",
    "standbys_to_prepare",
    "start_members",
    "trainer_error_recovered",
    "trainer_error_verdict",
    "unreported_losses",
]
