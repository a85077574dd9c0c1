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
(*                                                                         *)
(* Issue 28 adds three things.  Each token carries two labels: the version *)
(* that computed it (lab) and the oldest version of the KV it attended to  *)
(* (kvLab, R-KV-VERSIONS).  With Async, a forward step is launched         *)
(* (Launch) and its tokens read back later (Land), and a window may open   *)
(* in between, as transformers' async batching does; LabelAtLaunch says    *)
(* the tokens carry the version of their launch (cbpause) rather than the  *)
(* one in force when they are read back (which LabelProp must catch).      *)
(* And a staleness bound (R-STALENESS): at the close of a window that set  *)
(* a new version, a request whose oldest label or KV is more than          *)
(* MaxStaleness versions behind is restarted from its prompt (OnStale =    *)
(* "restart") or ended with an error ("abort"); MaxStaleness = 99 (NONE)  *)
(* is no bound.  A request is restarted at most MaxRestarts times; once    *)
(* they are spent it ends as "abort" ends it (issue 40: without the        *)
(* budget, a request needing more steps than the updates leave it was      *)
(* restarted at every window for ever; StaleRestarts.tla proves the end    *)
(* with windows unbounded).                                                *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    Requests,     \* generation requests
    Tokens,       \* tokens each request generates
    MaxVersion,   \* how many weight updates the holders make
    MaxWindows,   \* how many pause windows the holders open
    Modes,        \* the modes the windows are opened in (PauseProtocol's)
    Forget,       \* the loop forgets its shared prefix blocks after an update
    Reject,       \* add_request refuses requests while a pause is held
    Async,        \* a step's tokens are read back after the next decision
    LabelAtLaunch,\* they carry the version of the step's launch
    MaxStaleness, \* the staleness bound, NONE (99) for none
    OnStale,      \* "restart" or "abort"
    MaxRestarts   \* how many times one request may be restarted (max_stale_restarts)

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
    kvLab,      \* [Requests -> Seq(versions)]: the oldest KV version each token attended to
    flight,     \* the version of the step launched and not read back, NONE if none (Async)
    inFlight,   \* the requests of that step
    outputs,    \* [Requests -> terminal outputs]
    aborted,    \* [Requests -> BOOLEAN]
    restarted,   \* [Requests -> how many times the staleness bound restarted it]
    windows,    \* how many windows were opened (the model's bound)
    last        \* the mode of the last window opened, 0 before any

vars == <<wv, win, drainAsked, changed, prefix, st, kv, adm, lab, kvLab, flight, inFlight, outputs, aborted,
          restarted, windows, last>>
steps == <<flight, inFlight, kvLab>>

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
    /\ \A i \in Requests : Len(kvLab[i]) = Len(lab[i]) /\ \A k \in 1..Len(kvLab[i]) : kvLab[i][k] \in Versions
    /\ flight \in Versions \cup {NONE}
    /\ inFlight \subseteq Requests
    /\ outputs \in [Requests -> 0..2]
    /\ aborted \in [Requests -> BOOLEAN]
    /\ restarted \in [Requests -> 0..MaxRestarts]
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
    /\ kvLab = [i \in Requests |-> << >>]
    /\ flight = NONE
    /\ inFlight = {}
    /\ outputs = [i \in Requests |-> 0]
    /\ aborted = [i \in Requests |-> FALSE]
    /\ restarted = [i \in Requests |-> 0]
    /\ windows = 0
    /\ last = 0

\* P-SUBMIT (R-ADMISSION): queued, or refused while a window is open when the
\* manager rejects then (the caller gets LoopPausedError and may retry).
Submit(i) ==
    /\ st[i] = "new"
    /\ st' = [st EXCEPT ![i] = IF Reject /\ (win # 0 \/ drainAsked) THEN "rejected" ELSE "waiting"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, restarted, windows, last>>
    /\ UNCHANGED steps

\* A rejected caller retries.
Retry(i) ==
    /\ st[i] = "rejected"
    /\ st' = [st EXCEPT ![i] = "new"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, restarted, windows, last>>
    /\ UNCHANGED steps

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
    /\ UNCHANGED <<wv, win, drainAsked, changed, lab, outputs, aborted, restarted, windows, last>>
    /\ UNCHANGED steps

\* The requests of S get one token each, labelled v, its KV label the
\* oldest KV it reads; one that has all its tokens finishes.
Produce(S, v) ==
    /\ lab' = [i \in Requests |-> IF i \in S THEN Append(lab[i], v) ELSE lab[i]]
    /\ kvLab' = [i \in Requests |-> IF i \in S THEN Append(kvLab[i], kv[i]) ELSE kvLab[i]]
    /\ st' = [i \in Requests |->
                IF i \in S /\ Len(lab[i]) + 1 = Tokens THEN "done" ELSE st[i]]
    /\ outputs' = [i \in Requests |->
                IF i \in S /\ Len(lab[i]) + 1 = Tokens THEN outputs[i] + 1 ELSE outputs[i]]
    /\ kv' = [i \in Requests |-> IF i \in S /\ Len(lab[i]) + 1 = Tokens THEN NONE ELSE kv[i]]

\* A forward step: every request of the batch gets one token, labelled with
\* the version in force.
Step ==
    /\ ~Async
    /\ win = 0
    /\ InBatch # {}
    /\ Produce(InBatch, wv)
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, adm, aborted, restarted, windows, last, flight, inFlight>>

\* Async: a step is launched with the weights in force ...
Launch ==
    /\ Async
    /\ win = 0
    /\ flight = NONE
    /\ InBatch # {}
    /\ flight' = wv
    /\ inFlight' = InBatch
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, st, kv, adm, lab, kvLab, outputs, aborted, restarted, windows, last>>

\* ... and its tokens are read back later, perhaps after a window (those of
\* a request the window retracted, aborted or restarted are dropped).
Land ==
    /\ flight # NONE
    /\ win = 0
    /\ Produce(inFlight \cap InBatch, IF LabelAtLaunch THEN flight ELSE wv)
    /\ flight' = NONE
    /\ inFlight' = {}
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, adm, aborted, restarted, windows, last>>

\* The group decides a pause in mode m (PauseProtocol's AllReduce).  A drain
\* with work first steps the batch, admitting nothing (DrainFirst); otherwise
\* the mode takes effect and the window opens.
Effect(m) ==
    CASE m = RETRACT ->
            /\ st' = [i \in Requests |-> IF i \in InBatch THEN "waiting" ELSE st[i]]
            /\ kv' = [i \in Requests |-> IF i \in InBatch THEN NONE ELSE kv[i]]
            /\ inFlight' = {}
            /\ UNCHANGED <<outputs, aborted>>
      [] m = ABORT ->
            LET ended == {i \in Requests : st[i] \in {"waiting", "batch"}} IN
            /\ st' = [i \in Requests |-> IF i \in ended THEN "done" ELSE st[i]]
            /\ outputs' = [i \in Requests |-> IF i \in ended THEN outputs[i] + 1 ELSE outputs[i]]
            /\ aborted' = [i \in Requests |-> aborted[i] \/ i \in ended]
            /\ kv' = [i \in Requests |-> IF i \in ended THEN NONE ELSE kv[i]]
            /\ inFlight' = {}
      [] OTHER -> UNCHANGED <<st, kv, outputs, aborted, inFlight>>

OpenWindow(m) ==
    /\ win = 0
    /\ m \in Modes
    /\ windows < MaxWindows
    /\ ~drainAsked \/ m \in {DRAIN, ABORT}   \* while a drain is asked, only as strong a mode
    /\ IF m = DRAIN /\ InBatch # {}
       THEN /\ drainAsked' = TRUE
            /\ UNCHANGED <<win, st, kv, outputs, aborted, windows, last, inFlight>>
       ELSE /\ win' = m
            /\ drainAsked' = FALSE
            /\ windows' = windows + 1
            /\ last' = m
            /\ Effect(m)
    /\ UNCHANGED <<wv, changed, prefix, adm, lab, kvLab, flight, restarted>>

\* The holder inside updates the weights (set_weight_version).
Update ==
    /\ win # 0
    /\ wv < MaxVersion
    /\ wv' = wv + 1
    /\ changed' = TRUE
    /\ UNCHANGED <<win, drainAsked, prefix, st, kv, adm, lab, outputs, aborted, restarted, windows, last>>
    /\ UNCHANGED steps

\* How far behind the version in force a request in flight is: its oldest
\* token label, and the version of the KV it holds (0 when it has neither).
Behind(i) ==
    LET olds == {lab[i][k] : k \in 1..Len(lab[i])} \cup (IF kv[i] = NONE THEN {} ELSE {kv[i]}) IN
    IF olds = {} THEN 0 ELSE wv - CHOOSE o \in olds : \A p \in olds : o <= p

Stale(i) == MaxStaleness # NONE /\ st[i] \in {"waiting", "batch"} /\ Behind(i) > MaxStaleness

\* The last holder leaves: the window closes; after an update the loop
\* forgets the blocks kept for sharing (cbpause), or keeps them (upstream),
\* and applies the staleness bound (R-STALENESS): a stale request is
\* restarted from its prompt while its restarted last (OnStale = "restart"),
\* and ends with an error otherwise.
StaleRestarted(stale) == {i \in stale : OnStale = "restart" /\ restarted[i] < MaxRestarts}
CloseWindow ==
    LET stale == IF changed THEN {i \in Requests : Stale(i)} ELSE {}
        again == StaleRestarted(stale)
        ends == stale \ again IN
    /\ win # 0
    /\ win' = 0
    /\ changed' = FALSE
    /\ prefix' = IF Forget /\ changed THEN NONE ELSE prefix
    /\ inFlight' = inFlight \ stale
    /\ kv' = [i \in Requests |-> IF i \in stale THEN NONE ELSE kv[i]]
    /\ st' = [i \in Requests |-> IF i \in again THEN "waiting" ELSE IF i \in ends THEN "done" ELSE st[i]]
    /\ lab' = [i \in Requests |-> IF i \in again THEN << >> ELSE lab[i]]
    /\ kvLab' = [i \in Requests |-> IF i \in again THEN << >> ELSE kvLab[i]]
    /\ outputs' = [i \in Requests |-> IF i \in ends THEN outputs[i] + 1 ELSE outputs[i]]
    /\ aborted' = [i \in Requests |-> aborted[i] \/ i \in ends]
    /\ restarted' = [i \in Requests |-> IF i \in again THEN restarted[i] + 1 ELSE restarted[i]]
    /\ UNCHANGED <<wv, drainAsked, adm, windows, last, flight>>

\* P-DELIVER.
Deliver(i) ==
    /\ st[i] = "done"
    /\ st' = [st EXCEPT ![i] = "delivered"]
    /\ UNCHANGED <<wv, win, drainAsked, changed, prefix, kv, adm, lab, outputs, aborted, restarted, windows, last>>
    /\ UNCHANGED steps

\* Every request delivered: the behaviour may stutter.
Finished ==
    /\ \A i \in Requests : st[i] = "delivered"
    /\ UNCHANGED vars

Next ==
    \/ \E i \in Requests : Submit(i) \/ Retry(i) \/ Admit(i) \/ Deliver(i)
    \/ Step \/ Launch \/ Land
    \/ \E m \in Modes : OpenWindow(m)
    \/ Update \/ CloseWindow
    \/ Finished

\* The loop steps, admits and delivers; holders leave (the premise of
\* PauseProtocol's liveness, HoldersLeave); a pause once asked opens
\* (PauseProtocol's R-PAUSE-RETURNS).  Callers and holders choose freely.
Fairness ==
    /\ WF_vars(Step) /\ WF_vars(Launch) /\ WF_vars(Land)
    /\ \A i \in Requests : WF_vars(Admit(i)) /\ WF_vars(Deliver(i))
    /\ WF_vars(CloseWindow)
    /\ WF_vars(drainAsked /\ OpenWindow(DRAIN))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Properties.                                                             *)

\* R-NOTHING-LOST-ONCE in every mode: at most one terminal output per
\* request, and exactly one once done.
\* R-SAMPLING, read by TraceRequestVersions (a loop that samples per request records, at each Land, the position
\* of the request's seed's stream each token was drawn at): a token of request i drawn at position d lands as its
\* token Len(lab[i]) + 1, so d is the number of tokens the request holds (a retract keeps them, a restart from the
\* prompt drops them: its stream starts again).  The model has no streams of its own: this is what a draw means.
DrawAtIndex(i, d) == d = Len(lab[i])

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

\* Each token's label is the version of the weights that computed it: the
\* version in force at its step, or at its launch (Async).
LabelProp == [][\A i \in Requests : Len(lab'[i]) = Len(lab[i]) + 1 =>
                    lab'[i][Len(lab'[i])] = IF Async THEN flight ELSE wv]_vars

\* R-KV-VERSIONS: each token's KV label is the oldest version of the KV it
\* attended to (the request's, which its own step only adds newer rows to).
KvLabelProp == [][\A i \in Requests : Len(kvLab'[i]) = Len(kvLab[i]) + 1 => kvLab'[i][Len(kvLab'[i])] = kv[i]]_vars

\* The KV a token attends to is never newer than the weights that computed
\* it, and never older than the request's admission (after a retract, the
\* recomputed KV is the new version's); along a request the KV labels only
\* grow.
KvLabelInv ==
    \A i \in Requests :
        /\ \A k \in 1..Len(kvLab[i]) : kvLab[i][k] <= lab[i][k]
        /\ \A k \in 1..(Len(kvLab[i]) - 1) : kvLab[i][k] <= kvLab[i][k + 1]

\* R-STALENESS: outside a window, no request in flight is more than
\* MaxStaleness versions behind (the bound is applied as a window closes;
\* the versions change only inside windows).
StalenessInv ==
    win = 0 => \A i \in Requests : ~Stale(i)

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
\* After a keep window that updated the weights, a token attends to KV of
\* older weights than its own (the KV label differs from the token's).
\* A window that updated the weights does find a request more than
\* MaxStaleness versions behind (the bound has work to do).
NeverStaleAtCloseWitness == ~(win # 0 /\ changed /\ \E i \in Requests : Stale(i))
NeverOlderKvWitness == \A i \in Requests : \A k \in 1..Len(kvLab[i]) : kvLab[i][k] = lab[i][k]

\* ... and one whose restarted are spent, ended by the bound (the budget has work to do).
NeverRestartsSpentWitness == ~\E i \in Requests : OnStale = "restart" /\ aborted[i] /\ restarted[i] = MaxRestarts
=============================================================================
