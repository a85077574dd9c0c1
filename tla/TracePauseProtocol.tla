------------------------- MODULE TracePauseProtocol -------------------------
(***************************************************************************)
(* Trace validation (as etcd-raft and CCF do it): replay a log recorded    *)
(* from PauseProtocol objects (cbpause.core.recorder; written as a TLA+    *)
(* module by cbpause.tlc.traces) against PauseProtocol.  Each log entry    *)
(* names the action, its rank, its holder and argument, and what the      *)
(* step left: every variable of the rank, and the holder's state.  It must *)
(* match an enabled action of the spec that leads to exactly that.  TLC   *)
(* accepts the trace when a behaviour reaches the end of the log          *)
(* (TraceMatched; TLC shows it by breaking the witness NeverMatched).      *)
(*                                                                         *)
(* Where the implementation is not atomic, and only there:                 *)
(*  - AllReduce, Barrier and Restart are one step of the whole group in    *)
(*    the spec and one call per rank in the code: the first rank's record  *)
(*    takes the group step, the others' records only check their state.   *)
(*    Until a rank has recorded its part, its object still shows what it  *)
(*    showed before the group step (`prev`), and the ranks that have not   *)
(*    caught up are `lagging`: a holder's or stopper's record on such a    *)
(*    rank is checked against that view, and the guards of RequestPause   *)
(*    and RequestStop, the two holder-side steps that read the loop's      *)
(*    variables, are evaluated on it (the spec's own CanRequestPause and   *)
(*    CanRequestStop, never a copy of them).                               *)
(*  - Requests: the real loop's records carry them (transformers'          *)
(*    integration writes them; a trace without any, from a loop that owns  *)
(*    no requests, runs with Requests = {}). Three of the spec's request   *)
(*    steps are taken as recorded: Submit (PauseProtocol.submit, the       *)
(*    acceptance check under the protocol's lock), Broadcast (every rank   *)
(*    records it once its collective returned: the first record takes the  *)
(*    step, and the other live ranks owe theirs (`owed`), which may come   *)
(*    after the driver went on: it has drained the next requests by then), *)
(*    and the failures of                                                  *)
(*    FailRemaining, inside the loop steps that take them. Two are the     *)
(*    requests' own records: Drain (one per request taken from the queue,  *)
(*    just before the rank's Observe, which then drains nothing:           *)
(*    TraceObserve) and Deliver (a terminal output handed to               *)
(*    the caller; for a request the spec still holds, the output is made   *)
(*    and delivered in one step: a request that finished, or failed        *)
(*    alone).  The spec's two steps per request are an abstraction of the  *)
(*    scheduler: the trace's EndStep moves no request (TraceEndStep), and  *)
(*    the driver records instead the first forward step of each request    *)
(*    (FirstStep: waiting -> active, request by request), so that InFlight *)
(*    is what the loop's drain decision reads (modes.busy): the AllReduce  *)
(*    record's draining flag is compared with the spec's, DrainFirst,      *)
(*    OpenWindow and the release of a dead holder take the spec's guards,  *)
(*    and a first step takes EndStep's (Admits: a drain that found work    *)
(*    admits no new request).                                              *)
(*    A request restarted stale (R-STALENESS: back at its prompt, no       *)
(*    longer in flight) is the one request step PauseProtocol does not     *)
(*    model: TraceStaleRestart, active -> waiting.  With Requests = {},    *)
(*    TraceStartStep is StartStep without its HasWork guard.  Every        *)
(*    invariant the spec's models check is checked on every state (and    *)
(*    MonotoneStopInv on every step: cbpause.tlc.traces.TRACE_INVARIANTS), *)
(*    and a trace that ends with every loop stopped must have delivered    *)
(*    every accepted request (DeliveredAtEnd).                             *)
(*  - HolderDies is not seen by the code when it happens: it is recorded   *)
(*    where the protocol learns it, just before its ReleaseDeadHolder (the *)
(*    dead thread did nothing in between, so the order is one the spec     *)
(*    allows).                                                             *)
(*  - Crash is not recorded by the rank that died: the harness that killed *)
(*    its process adds the record, which says only that the rank is dead.  *)
(***************************************************************************)
EXTENDS PauseProtocol, Sequences

CONSTANT Log

VARIABLES
    i,        \* how many records of the log were matched
    lagging,  \* ranks whose object has not recorded its part of the last group step
    prev,     \* [Ranks -> View]: what each rank's object showed before that group step
    owed,     \* ranks that have not recorded the last Broadcast, which another rank's record took
    dropped   \* <<r, q>>: peer r's copy of request q left its scheduler without a step (PeerDrop)

traceVars == <<i, lagging, prev, owed, dropped>>

\* What a rank's object shows of the loop's and the group's variables.
View(r) ==
    [phase |-> phase[r], localStatus |-> localStatus[r], tpStatus |-> tpStatus,
     tpPause |-> tpPause, obsStatus |-> obsStatus[r], obsPause |-> obsPause[r],
     draining |-> draining[r]]

\* Every rank's View (primed as a whole: View(r)' would prime r too, where r
\* is read from the log at i).
Views == [s \in Ranks |-> View(s)]

TraceInit == Init /\ i = 0 /\ lagging = {} /\ prev = Views /\ owed = {} /\ dropped = {}

\* The spec has no cancellation: the trace takes a cancelled request's output
\* as a Deliver from the scheduler (TraceDeliver).  A drain whose requests in
\* flight were all cancelled then holds only waiting requests (Admits false),
\* which the loop asked to flush does not exit on: it goes round through an
\* empty step until the next decision ends the drain (a state the spec, whose
\* requests in flight end only by a step, never reaches).
FlushThroughDrain ==
    /\ tpStatus = FLUSH_AND_STOP
    /\ ~Admits
    /\ \E q \in Requests : req[q] = "waiting"

\* A trace without request records (Requests = {}) steps whenever its loop did.
TraceStartStep(r) ==
    /\ CanStartStep(r, Requests = {} \/ HasWork \/ FlushThroughDrain)
    /\ Move(r, "step")

TraceObserve(r) == ObserveLoop(r) /\ UNCHANGED requestVars

TraceEndStep(r) == EndStepLoop(r) /\ UNCHANGED requestVars

\* The driver's first forward step of request q ended: q is in flight (the
\* spec's EndStep, waiting -> active, request by request: the scheduler
\* decides which waiting requests a step takes, and a request whose first
\* step also ends it goes from waiting to delivered, TraceDeliver).  The
\* driver records it after its EndStep, before its next Observe; the
\* AllReduce after it reads InFlight for the drain's decision.
TraceFirstStep(q) ==
    /\ phase[Driver] = "read"
    /\ req[q] = "waiting"
    /\ Admits  \* EndStep's guard: a drain that found work admits no new request
    /\ req' = [req EXCEPT ![q] = "active"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* R-STALENESS's restart (RequestVersions' StaleRestarted), the one step the
\* trace takes that PauseProtocol does not model: at the close of a window
\* that set new weights, a request in flight too many versions behind goes
\* back to its prompt, waiting and no longer in flight (modes.restart_stale).
\* It changes no variable of the loop's, and nothing is lost: the request is
\* still held.
TraceStaleRestart(q) ==
    /\ phase[Driver] = "body"
    /\ req[q] = "active"
    /\ req' = [req EXCEPT ![q] = "waiting"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* A peer's copy of request q leaves its scheduler without a step: cancelled
\* (the payload carried the cancellation to every rank) or refused at its
\* admission (failed alone).  The driver's copy does the same, and the
\* driver's Deliver record of its output may come after the peer went on:
\* the peer's batch has no work from q then (PeerWork), which the peer's Idle
\* and flush ExitLoop read.  It changes no variable of the spec.
TracePeerDrop(r, q) ==
    /\ r # Driver
    /\ UNCHANGED vars
    /\ dropped' = dropped \cup {<<r, q>>}

\* Whether rank r's own batch has work: the spec's HasWork, less the requests
\* a peer dropped.
PeerWork(r) == \E q \in Requests : Workable(q) /\ <<r, q>> \notin dropped

\* The spec's Idle and ExitLoop, with the rank's own view of its work.
TraceIdle(r) == CanIdle(r, PeerWork(r)) /\ Move(r, "read")

TraceExitLoop(r) == CanExitLoop(r, PeerWork(r)) /\ Exit(r)

\* A group step taken by the first rank to record it; the later ranks' records
\* stutter, each catching its rank up: only a rank that has not recorded its
\* part yet (a second record of one group step by the same rank is refused).
GroupStep(A, r, before) ==
    /\ UNCHANGED owed
    /\ IF phase[r] = before
       THEN /\ A
            /\ lagging' = {q \in Ranks : q # r /\ phase[q] = before}
            /\ prev' = Views
       ELSE /\ r \in lagging
            /\ UNCHANGED vars
            /\ lagging' = lagging \ {r}
            /\ UNCHANGED prev

\* The view the guards of a holder's step read: a lagging rank's object has not
\* taken the group step yet.
Seen(r) == IF r \in lagging THEN prev[r] ELSE View(r)

\* RequestPause in the mode m the record gives, with the spec's guards
\* (CanRequestPause on what the holder's rank showed; a window not closing).
TraceRequestPause(h, m) ==
    LET r == RankOf[h] IN
    /\ CanRequestPause(Seen(r).phase, Seen(r).localStatus, fatal[r])
    /\ ~closing[r]
    /\ AskPause(h, m)

\* QueuePause in the mode m the record gives, with the spec's guards.
TraceQueuePause(h, m) ==
    LET r == RankOf[h] IN
    /\ CanRequestPause(Seen(r).phase, Seen(r).localStatus, fatal[r])
    /\ closing[r]
    /\ Queue(h, m)

\* Submit of request q, accepted (ok = 1) or refused, with the spec's guard
\* (CanSubmit) on what the driver showed.
TraceSubmit(q, ok) ==
    /\ req[q] = "new"
    /\ (ok = 1) = CanSubmit(Seen(Driver).phase, Seen(Driver).localStatus, fatal[Driver])
    /\ req' = [req EXCEPT ![q] = IF ok = 1 THEN "queued" ELSE "rejected"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* The driver's loop takes request q from its queue, just before its Observe.
TraceDrain(q) ==
    /\ phase[Driver] = "read"
    /\ req[q] = "queued"
    /\ req' = [req EXCEPT ![q] = "drained"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* Every rank records the broadcast once its collective returned: the first
\* record takes the group step, and each other live rank owes its own record,
\* which changes nothing.  (A rank's record can come late: once the broadcast
\* returned, the driver needs no peer until its next all-reduce, and may have
\* drained the next requests by then; found by a real TP=2 trace, issue 38.)
TraceBroadcast(r) ==
    IF r \in owed
    THEN /\ phase[r] = "body"  \* a rank records its part before its next step
         /\ UNCHANGED vars
         /\ owed' = owed \ {r}
    ELSE /\ Broadcast
         /\ owed' = {q \in Ranks : q # r /\ phase[q] # "dead"}

\* A terminal output of request q reaches its caller: the output the spec made
\* already (Deliver), or one made and delivered in the same step.
TraceDeliver(q) ==
    \/ Deliver(q)
    \/ /\ req[q] \in Held
       /\ phase[Driver] # "dead"
       /\ req' = [req EXCEPT ![q] = "delivered"]
       /\ out' = [out EXCEPT ![q] = out[q] + 1]
       /\ UNCHANGED <<loopVars, groupVars, holderVars, restarts>>

\* RequestStop on a lagging rank: the object's status grows from what it showed;
\* the spec's may have grown past it already, and then the step changes nothing.
TraceRequestStop(r, s) ==
    \/ /\ r \notin lagging
       /\ RequestStop(r, s)
    \/ /\ r \in lagging
       /\ CanRequestStop(Seen(r).phase, Seen(r).localStatus, s)
       /\ IF localStatus[r] < s THEN RequestStop(r, s) ELSE UNCHANGED vars

Step(e) ==
    LET r == e.r
        h == e.h
    IN CASE e.a = "Observe"           -> TraceObserve(r)
         [] e.a = "AllReduce"         -> GroupStep(AllReduce, r, "reduce")
         [] e.a = "OpenWindow"        -> OpenWindow(r)
         [] e.a = "DrainFirst"        -> DrainFirst(r)
         [] e.a = "SkipWindow"        -> SkipWindow(r)
         [] e.a = "ParkForPeer"       -> ParkForPeer(r)
         [] e.a = "JoinPeerPause"     -> JoinPeerPause(r)
         [] e.a = "PeerParkTimeout"   -> PeerParkTimeout(r)
         [] e.a = "CollectiveTimeout" -> CollectiveTimeout(r)
         [] e.a = "CloseWindow"       -> CloseWindow(r)
         [] e.a = "Barrier"           -> GroupStep(Barrier, r, "barrier")
         [] e.a = "NoPause"           -> NoPause(r)
         [] e.a = "StartStep"         -> TraceStartStep(r)
         [] e.a = "EndStep"           -> TraceEndStep(r)
         [] e.a = "Idle"              -> TraceIdle(r)
         [] e.a = "ExitLoop"          -> TraceExitLoop(r)
         [] e.a = "RequestPause"      -> TraceRequestPause(h, e.arg)
         [] e.a = "QueuePause"        -> TraceQueuePause(h, e.arg)
         [] e.a = "LeaveQueue"        -> LeaveQueue(h)
         [] e.a = "EnterPause"        -> EnterPause(h)
         [] e.a = "LeavePause"        -> LeavePause(h)
         [] e.a = "PauseFails"        -> PauseFails(h)
         [] e.a = "Interrupt"         -> Interrupt(h)
         [] e.a = "PauseTimeout"      -> PauseTimeout(h)
         [] e.a = "HolderDies"        -> HolderDies(h)
         [] e.a = "ReleaseDeadHolder" -> ReleaseDeadHolder(h)
         [] e.a = "RequestStop"       -> TraceRequestStop(r, e.arg)
         [] e.a = "RecordFatalError"  -> RecordFatalError(r)
         [] e.a = "FailLoop"          -> FailLoop(r)
         [] e.a = "Crash"             -> Crash(r)
         [] e.a = "Restart"           -> GroupStep(Restart, r, "stopped")
         [] e.a = "Submit"            -> TraceSubmit(e.q, e.arg)
         [] e.a = "Drain"             -> TraceDrain(e.q)
         [] e.a = "Broadcast"         -> TraceBroadcast(r)
         [] e.a = "Deliver"           -> TraceDeliver(e.q)
         [] e.a = "FirstStep"         -> TraceFirstStep(e.q)
         [] e.a = "StaleRestart"      -> TraceStaleRestart(e.q)
         [] e.a = "PeerDrop"          -> TracePeerDrop(r, e.q)
         [] OTHER                     -> FALSE

GroupActions == {"AllReduce", "Barrier", "Restart"}

\* The lagging set and the views outside group steps: unchanged, except that a
\* stop asked on a lagging rank grows the status its object shows.
KeepLag(e) ==
    /\ lagging' = IF e.a = "Crash" THEN lagging \ {e.r} ELSE lagging
    /\ e.a # "Broadcast" => owed' = IF e.a = "Crash" THEN owed \ {e.r} ELSE owed  \* (TraceBroadcast sets it)
    /\ prev' = IF e.a = "RequestStop" /\ e.r \in lagging
               THEN [prev EXCEPT ![e.r].localStatus =
                        IF e.arg >= prev[e.r].tpStatus THEN e.arg ELSE prev[e.r].tpStatus]
               ELSE prev

\* What the record says the step left: every variable of the rank (as its
\* object shows them: a lagging rank's loop and group variables are those of
\* `prev`), and the holder's state for a holder's step.
Matches(e) ==
    LET r == e.r
        v == e.v
        shown == IF r \in lagging' THEN prev'[r] ELSE Views'[r]
    IN IF e.a = "Crash" THEN phase'[r] = "dead" ELSE  \* all the harness knows of a killed rank
       /\ fatal'[r] = v.fatal
       /\ paused'[r] = v.paused
       /\ closing'[r] = v.closing
       /\ count'[r] = v.count
       /\ shown.phase = v.phase
       /\ shown.localStatus = v.localStatus
       /\ shown.tpStatus = v.tpStatus
       /\ shown.tpPause = v.tpPause
       /\ shown.obsStatus = v.obsStatus
       /\ shown.obsPause = v.obsPause
       /\ shown.draining = v.draining
       /\ e.h # 0 => hs'[e.h] = e.hs

TraceNext ==
    /\ i < Len(Log)
    /\ Step(Log[i + 1])
    /\ IF Log[i + 1].a \in GroupActions THEN TRUE ELSE KeepLag(Log[i + 1])
    /\ Log[i + 1].a # "PeerDrop" => UNCHANGED dropped
    /\ Matches(Log[i + 1])
    /\ i' = i + 1

\* R-NOTHING-LOST-DELIVERED on a finite trace: once the whole log is matched and
\* every loop has ended, every accepted request was delivered (unless the
\* driver's process died with them).
DeliveredAtEnd ==
    (i = Len(Log) /\ \A r \in Ranks : phase[r] \in {"stopped", "dead"} /\ phase[Driver] # "dead")
        => \A q \in Requests : req[q] \in {"new", "rejected", "delivered"}

\* The trace is matched: a behaviour of the spec went through every record.
TraceMatched == i = Len(Log)

\* TLC is asked for a state where TraceMatched holds as the witness models ask
\* for theirs (Witness_Never*): this invariant fails exactly there, and the trace
\* is accepted then; TLC's search is the "there is a behaviour" of the
\* definition.  (CCF's and etcd-raft's temporal TraceMatched needs
\* TLCGet("queue") inside liveness checking, which this TLC leaves undefined:
\* "TLCGet(queue) was undefined", checked 2026-12-05.)
NeverMatched == ~TraceMatched
=============================================================================
