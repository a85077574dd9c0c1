-------------------------- MODULE RequestVersions --------------------------
(***************************************************************************)
(* What a pause does to the requests of the batch: the data plane under    *)
(* the control plane of PauseProtocol.  spec/PROTOCOL.md, R-MODES,         *)
(* R-VERSIONS, R-NO-STALE-PREFIX and R-ADMISSION, in prose.                *)
(*                                                                         *)
(* One loop (the ranks of a TP group hold copies of one batch, and         *)
(* PauseProtocol checks that they decide alike), weights with a version,   *)
(* requests with the version of the KV they read and of each token they    *)
(* generated, and the blocks kept for prefix sharing, with the version     *)
(* they were computed with.  Every request has the same prompt: the worst  *)
(* case for prefix sharing.  A pause window is opened in a mode (the one   *)
(* the group agreed, PauseProtocol's tpPause); inside it a holder may      *)
(* update the weights; the window closes when the holder leaves.           *)
(*                                                                         *)
(* Forget is TRUE for cbpause (the blocks kept for sharing are forgotten   *)
(* at the end of a window that changed the weights, D6's fix) and FALSE   *)
(* for transformers 5.23 (they are kept): the model of today's behaviour,  *)
(* which must break NoStalePrefixInv.  Modes is {KEEP} there too.          *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    Requests,     \* generation requests
    Tokens,       \* tokens each request generates
    MaxVersion,   \* how many weight updates the holders make
    MaxWindows,   \* how many pause windows the holders open
    Modes,        \* the modes the windows are opened in (PauseProtocol's)
    Forget,       \* the loop forgets its shared prefix blocks after an update
    Reject        \* add_request refuses requests while a pause is held

KEEP == 1
RETRACT == 2
DRAIN == 3
ABORT == 4
NONE == 99        \* no KV (no version is this high)

VARIABLES
    wv,         \* the version of the weights in force
    win,        \* the mode of the open window, 0 when none is open
    drainAsked, \* a drain is asked: no admission; the window opens once the batch is empty
    changed,    \* the weights changed in the open window
    prefix,     \* the version of the blocks kept for prefix sharing, NONE if none
    st,         \* [Requests -> {"new", "waiting", "batch", "done", "delivered", "rejected"}]
    kv,         \* [Requests -> version of the oldest KV the request reads, NONE if none]
    adm,        \* [Requests -> the version in force when the request was (last) admitted]
    lab,        \* [Requests -> Seq(versions)]: the label of each token it generated
    outputs,    \* [Requests -> terminal outputs]
    aborted,    \* [Requests -> BOOLEAN]
    windows,    \* how many windows were opened (the model's bound)
    last        \* the mode of the last window opened, 0 before any

vars == <<wv, win, drainAsked, changed, prefix, st, kv, adm, lab, outputs, aborted, windows, last>>

Versions == 0..MaxVersion
InBatch == {i \in Requests : st[i] = "batch"}
Min(a, b) == IF a < b THEN a ELSE b

TypeOK ==
    /\ wv \in Versions
    /\ win \in {0} \cup Modes
    /\ drainAsked \in BOOLEAN
    /\ changed \in BOOLEAN
    /\ prefix \in Versions \cup {NONE}
    /\ st \in [Requests -> {"new", "waiting", "batch", "done", "delivered", "rejected"}]
    /\ kv \in [Requests -> Versions \cup {NONE}]
    /\ adm \in [Requests -> Versions]
    /\ \A i \in Requests : Len(lab[i]) <= Tokens /\ \A k \in 1..Len(lab[i]) : lab[i][k] \in Versions
    /\ outputs \in [Requests -> 0..2]
    /\ aborted \in [Requests -> BOOLEAN]
    /\ windows \in 0..MaxWindows
    /\ last \in {0} \cup Modes

Init ==
    /\ wv = 0
    /\ win = 0
    /\ drainAsked = FALSE
    /\ changed = FALSE
    /\ prefix = NONE
    /\ st = [i \in Requests |-> "new"]
    /\ kv = [i \in Requests |-> NONE]
    /\ adm = [i \in Requests |-> 0]
    /\ lab = [i \in Requests |-> << >>]
    /\ outputs = [i \in Requests |-> 0]
    /\ aborted = [i \in Requests |-> FALSE]
    /\ windows = 0
    /\ last = 0

\* P-SUBMIT (R-ADMISSION): queued, or refused while a window is open when the
\* manager rejects then (the caller gets LoopPausedError and may retry).
Submit(i) ==
    /\ st[i] = "new"
    /\ st' = [st EXCEPT ![i] = IF Reject /\ (win # 0 \/ drainAsked) THEN "rejected" ELSE "waiting"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, windows, last>>

\* A rejected caller retries.
Retry(i) ==
    /\ st[i] = "rejected"
    /\ st' = [st EXCEPT ![i] = "new"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, windows, last>>

\* The scheduler admits a waiting request into the batch (not in a window,
\* not while draining).  Its prefill reads the shared prompt blocks if any
\* are kept (their version), else computes them with the weights in force and
\* keeps them for sharing.  A retracted request is prefilled again the same
\* way (its prompt and the tokens it had).
Admit(i) ==
    /\ win = 0
    /\ ~drainAsked
    /\ st[i] = "waiting"
    /\ st' = [st EXCEPT ![i] = "batch"]
    /\ kv' = [kv EXCEPT ![i] = IF prefix = NONE THEN wv ELSE Min(prefix, wv)]
    /\ prefix' = IF prefix = NONE THEN wv ELSE prefix
    /\ adm' = [adm EXCEPT ![i] = wv]
    /\ UNCHANGED <<wv, win, drainAsked, changed, lab, outputs, aborted, windows, last>>

\* A forward step: every request of the batch gets one token, labelled with
\* the version in force; one that has all its tokens finishes.
Step ==
    /\ win = 0
    /\ InBatch # {}
    /\ lab' = [i \in Requests |-> IF i \in InBatch THEN Append(lab[i], wv) ELSE lab[i]]
    /\ st' = [i \in Requests |->
                IF i \in InBatch /\ Len(lab[i]) + 1 = Tokens THEN "done" ELSE st[i]]
    /\ outputs' = [i \in Requests |->
                IF i \in InBatch /\ Len(lab[i]) + 1 = Tokens THEN outputs[i] + 1 ELSE outputs[i]]
    /\ kv' = [i \in Requests |-> IF i \in InBatch /\ Len(lab[i]) + 1 = Tokens THEN NONE ELSE kv[i]]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, adm, aborted, windows, last>>

\* The group decides a pause in mode m (PauseProtocol's AllReduce).  A drain
\* with work first steps the batch, admitting nothing (DrainFirst); otherwise
\* the mode takes effect and the window opens.
Effect(m) ==
    CASE m = RETRACT ->
            /\ st' = [i \in Requests |-> IF i \in InBatch THEN "waiting" ELSE st[i]]
            /\ kv' = [i \in Requests |-> IF i \in InBatch THEN NONE ELSE kv[i]]
            /\ UNCHANGED <<outputs, aborted>>
      [] m = ABORT ->
            LET ended == {i \in Requests : st[i] \in {"waiting", "batch"}} IN
            /\ st' = [i \in Requests |-> IF i \in ended THEN "done" ELSE st[i]]
            /\ outputs' = [i \in Requests |-> IF i \in ended THEN outputs[i] + 1 ELSE outputs[i]]
            /\ aborted' = [i \in Requests |-> aborted[i] \/ i \in ended]
            /\ kv' = [i \in Requests |-> IF i \in ended THEN NONE ELSE kv[i]]
      [] OTHER -> UNCHANGED <<st, kv, outputs, aborted>>

OpenWindow(m) ==
    /\ win = 0
    /\ m \in Modes
    /\ windows < MaxWindows
    /\ ~drainAsked \/ m \in {DRAIN, ABORT}   \* while a drain is asked, only as strong a mode
    /\ IF m = DRAIN /\ InBatch # {}
       THEN /\ drainAsked' = TRUE
            /\ UNCHANGED <<win, st, kv, outputs, aborted, windows, last>>
       ELSE /\ win' = m
            /\ drainAsked' = FALSE
            /\ windows' = windows + 1
            /\ last' = m
            /\ Effect(m)
    /\ UNCHANGED <<wv, changed, prefix, adm, lab>>

\* The holder inside updates the weights (set_weight_version).
Update ==
    /\ win # 0
    /\ wv < MaxVersion
    /\ wv' = wv + 1
    /\ changed' = TRUE
    /\ UNCHANGED <<win, drainAsked, prefix, st, kv, adm, lab, outputs, aborted, windows, last>>

\* The last holder leaves: the window closes; after an update the loop
\* forgets the blocks kept for sharing (cbpause), or keeps them (upstream).
CloseWindow ==
    /\ win # 0
    /\ win' = 0
    /\ changed' = FALSE
    /\ prefix' = IF Forget /\ changed THEN NONE ELSE prefix
    /\ UNCHANGED <<wv, drainAsked, st, kv, adm, lab, outputs, aborted, windows, last>>

\* P-DELIVER.
Deliver(i) ==
    /\ st[i] = "done"
    /\ st' = [st EXCEPT ![i] = "delivered"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, windows, last>>

\* Every request delivered: the behaviour may stutter.
Finished ==
    /\ \A i \in Requests : st[i] = "delivered"
    /\ UNCHANGED vars

Next ==
    \/ \E i \in Requests : Submit(i) \/ Retry(i) \/ Admit(i) \/ Deliver(i)
    \/ Step
    \/ \E m \in Modes : OpenWindow(m)
    \/ Update \/ CloseWindow
    \/ Finished

\* The loop steps, admits and delivers; holders leave (the premise of
\* PauseProtocol's liveness, HoldersLeave); a pause once asked opens
\* (PauseProtocol's R-PAUSE-RETURNS).  Callers and holders choose freely.
Fairness ==
    /\ WF_vars(Step)
    /\ \A i \in Requests : WF_vars(Admit(i)) /\ WF_vars(Deliver(i))
    /\ WF_vars(CloseWindow)
    /\ WF_vars(drainAsked /\ OpenWindow(DRAIN))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Properties.                                                             *)

\* R-NOTHING-LOST-ONCE in every mode: at most one terminal output per
\* request, and exactly one once done.
NothingLostInv ==
    \A i \in Requests :
        /\ outputs[i] <= 1
        /\ st[i] \in {"done", "delivered"} <=> outputs[i] = 1

\* R-VERSIONS: every token is labelled with a version that was in force, in
\* the order the versions came; a finished request has all its tokens.
LabelInv ==
    \A i \in Requests :
        /\ \A k \in 1..Len(lab[i]) : lab[i][k] <= wv
        /\ \A k \in 1..(Len(lab[i]) - 1) : lab[i][k] <= lab[i][k + 1]
        /\ (st[i] \in {"done", "delivered"} /\ ~aborted[i]) => Len(lab[i]) = Tokens

\* Each token's label is the version in force at the step that produced it.
LabelProp == [][\A i \in Requests : Len(lab'[i]) = Len(lab[i]) + 1 => lab'[i][Len(lab'[i])] = wv]_vars

\* R-NO-STALE-PREFIX (D6): no request reads KV computed with weights older
\* than those in force when it was admitted.
NoStalePrefixInv ==
    \A i \in Requests : st[i] = "batch" => kv[i] >= adm[i]

\* R-MODES, retract: inside a RETRACT window no request holds KV, so after it
\* every request of the batch was prefilled with the weights of its
\* admission; in DRAIN and ABORT windows the batch is empty.
ModeEffectInv ==
    /\ win = RETRACT => \A i \in Requests : kv[i] = NONE
    /\ win \in {DRAIN, ABORT} => InBatch = {}

\* R-MODES, retract: after a RETRACT window (and until the next window), no
\* step runs a request whose KV predates the weights in force.
RetractInv ==
    last = RETRACT /\ win = 0 => \A i \in InBatch : kv[i] = wv

\* R-NOTHING-LOST-DELIVERED: every request submitted and accepted is
\* delivered (a rejected caller may keep retrying: it is not accepted).
NothingLostProp ==
    \A i \in Requests : (st[i] = "waiting") ~> (st[i] = "delivered")

-----------------------------------------------------------------------------
(* Witnesses (must fail): an update does happen while a request is in     *)
(* flight and it goes on with its KV (keep); a token of a newer version    *)
(* follows one of an older (a span boundary); a request is aborted.        *)

NeverMixedLabelsWitness ==
    \A i \in Requests : \A k \in 1..(Len(lab[i]) - 1) : lab[i][k] = lab[i][k + 1]
NeverAbortedWitness == \A i \in Requests : ~aborted[i]
NeverStaleInFlightWitness == \A i \in Requests : st[i] = "batch" => kv[i] = NONE \/ kv[i] = wv
\* A retract does free the KV of a request with tokens, which then runs
\* again after an update; a drain does hold admission while it steps.
NeverRetractedWitness ==
    ~(last = RETRACT /\ wv > 0 /\ \E i \in InBatch : Len(lab[i]) > 0 /\ lab[i][1] < wv)
NeverDrainsWitness == \A i \in Requests : ~(drainAsked /\ st[i] = "waiting")
=============================================================================
