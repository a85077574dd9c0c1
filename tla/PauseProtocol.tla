--------------------------- MODULE PauseProtocol ---------------------------
(***************************************************************************)
(* cbpause: pausing, stopping and failing a continuous-batching loop,      *)
(* under tensor parallelism.  The prose twin of this module is             *)
(* spec/PROTOCOL.md; every action here has a requirement of the same name  *)
(* there (P-...), and a Python method of the same name in snake case in    *)
(* src/cbpause/.                                                           *)
(*                                                                         *)
(* One loop per rank runs the iteration of transformers' continuous        *)
(* batching:                                                               *)
(*                                                                         *)
(*   read -> reduce -> decided -> [window | peer] -> barrier -> body       *)
(*        -> step -> read ...                                              *)
(*                                                                         *)
(* Observe reads the local stop status and whether a local pause is        *)
(* pending; AllReduce is the MAX all-reduce of the group                   *)
(* (DistributedHelper.tp_all_reduce_state); the pause window and the       *)
(* barrier follow; then the forward step.  Holders are threads that pause  *)
(* the loop of their rank.  The environment interrupts waiting holders,    *)
(* injects fatal errors into the forward step, kills ranks, and asks for   *)
(* stops; none of that is fair.                                            *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    Ranks,        \* a set of integers; the smallest is the TP driver
    Holders,      \* holder threads
    RankOf,       \* [Holders -> Ranks]: the rank whose loop a holder pauses
    Requests,     \* generation requests, submitted to the driver
    Faults,       \* subset of {"interrupt", "timeout", "error", "crash", "stop"}
                  \* ("stray" too, used by the upstream model only)
    MaxRestarts   \* how many times the group may be cleared and restarted

ASSUME RankOf \in [Holders -> Ranks]
ASSUME Faults \subseteq {"interrupt", "timeout", "error", "crash", "stop", "stray"}

\* Stop statuses (transformers' BackgroundThreadStatus constants).
DONT_STOP == 0
FLUSH_AND_STOP == 1
HARD_STOP == 2
STOPPED == 3

Driver == CHOOSE r \in Ranks : \A q \in Ranks : r <= q

Max(S) == CHOOSE m \in S : \A x \in S : x <= m

VARIABLES
    pc,        \* [Ranks -> LoopStates]: where each rank's loop is
    stop,      \* [Ranks -> 0..3]: local stop status (local_status)
    tpStop,    \* stop status agreed by the last all-reduce (tp_status)
    tpPause,   \* pause decision of the last all-reduce
    obsStop,   \* [Ranks -> 0..3]: stop status each rank sent to the all-reduce
    obsPause,  \* [Ranks -> BOOLEAN]: pause request each rank sent to it
    fatal,     \* [Ranks -> BOOLEAN]: a fatal error is recorded
    paused,    \* [Ranks -> BOOLEAN]: the pause window is open to holders
    count,     \* [Ranks -> Int]: holders of the rank waiting or inside
    hs,        \* [Holders -> {"idle", "waiting", "inside"}]
    req,       \* [Requests -> RequestStates]
    out,       \* [Requests -> Nat]: terminal outputs produced per request
    restarts,  \* number of Restart steps taken
    crashes    \* number of Crash steps taken

vars == <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
          count, hs, req, out, restarts, crashes>>

LoopStates == {"read", "reduce", "decided", "window", "peer", "barrier",
               "body", "step", "stopped", "dead"}
RequestStates == {"new", "queued", "active", "done", "delivered", "rejected"}

\* R-TYPE.
TypeOK ==
    /\ pc \in [Ranks -> LoopStates]
    /\ stop \in [Ranks -> DONT_STOP..STOPPED]
    /\ tpStop \in DONT_STOP..STOPPED
    /\ tpPause \in BOOLEAN
    /\ obsStop \in [Ranks -> DONT_STOP..STOPPED]
    /\ obsPause \in [Ranks -> BOOLEAN]
    /\ fatal \in [Ranks -> BOOLEAN]
    /\ paused \in [Ranks -> BOOLEAN]
    /\ count \in [Ranks -> Int]
    /\ hs \in [Holders -> {"idle", "waiting", "inside"}]
    /\ req \in [Requests -> RequestStates]
    /\ out \in [Requests -> Nat]
    /\ restarts \in Nat
    /\ crashes \in Nat

HoldersOf(r) == {h \in Holders : RankOf[h] = r}
Live(r) == pc[r] \notin {"stopped", "dead"}
AnyInside == \E h \in Holders : hs[h] = "inside" /\ pc[RankOf[h]] # "dead"
HasWork == \E i \in Requests : req[i] = "active"

\* Every request the driver still holds gets its terminal (failed) output.
FailRemaining(r) ==
    IF r = Driver
    THEN /\ req' = [i \in Requests |->
                      IF req[i] \in {"queued", "active"} THEN "done" ELSE req[i]]
         /\ out' = [i \in Requests |->
                      IF req[i] \in {"queued", "active"} THEN out[i] + 1 ELSE out[i]]
    ELSE UNCHANGED <<req, out>>

\* A holder stops waiting or holding: the count drops, and the last one out
\* closes the window (transformers' _drop_pause_request).
Drop(h) ==
    LET r == RankOf[h] IN
    /\ hs' = [hs EXCEPT ![h] = "idle"]
    /\ count' = [count EXCEPT ![r] = count[r] - 1]
    /\ paused' = IF count[r] - 1 = 0 THEN [paused EXCEPT ![r] = FALSE] ELSE paused

Init ==
    /\ pc = [r \in Ranks |-> "read"]
    /\ stop = [r \in Ranks |-> DONT_STOP]
    /\ tpStop = DONT_STOP
    /\ tpPause = FALSE
    /\ obsStop = [r \in Ranks |-> DONT_STOP]
    /\ obsPause = [r \in Ranks |-> FALSE]
    /\ fatal = [r \in Ranks |-> FALSE]
    /\ paused = [r \in Ranks |-> FALSE]
    /\ count = [r \in Ranks |-> 0]
    /\ hs = [h \in Holders |-> "idle"]
    /\ req = [i \in Requests |-> "new"]
    /\ out = [i \in Requests |-> 0]
    /\ restarts = 0
    /\ crashes = 0

-----------------------------------------------------------------------------
(* The loop of rank r.                                                     *)

\* P-OBSERVE: read the local stop status and the pending pause request for
\* the all-reduce; the driver drains its request queue into the batch.
Observe(r) ==
    /\ pc[r] = "read"
    /\ obsStop' = [obsStop EXCEPT ![r] = stop[r]]
    /\ obsPause' = [obsPause EXCEPT ![r] = count[r] > 0]
    /\ pc' = [pc EXCEPT ![r] = "reduce"]
    /\ req' = IF r = Driver
              THEN [i \in Requests |-> IF req[i] = "queued" THEN "active" ELSE req[i]]
              ELSE req
    /\ UNCHANGED <<stop, tpStop, tpPause, fatal, paused, count, hs, out,
                   restarts, crashes>>

\* P-ALL-REDUCE: the MAX all-reduce of stop status and pause request; needs
\* every rank of the group (a dead or exited rank blocks it).
AllReduce ==
    /\ \A r \in Ranks : pc[r] = "reduce"
    /\ LET s == Max({obsStop[r] : r \in Ranks}) IN
       /\ tpStop' = s
       /\ stop' = [r \in Ranks |-> IF stop[r] >= s THEN stop[r] ELSE s]
    /\ tpPause' = \E r \in Ranks : obsPause[r]
    /\ pc' = [r \in Ranks |-> "decided"]
    \* What was sent is spent; forgetting it keeps the state space small.
    /\ obsStop' = [r \in Ranks |-> DONT_STOP]
    /\ UNCHANGED <<obsPause, fatal, paused, count, hs, req, out,
                   restarts, crashes>>

PauseDecided(r) == pc[r] = "decided" /\ tpStop < HARD_STOP /\ tpPause

\* P-OPEN-WINDOW: the group decided to pause and a local holder is pending: open
\* the window and park until the last holder leaves.
OpenWindow(r) ==
    /\ PauseDecided(r)
    /\ count[r] > 0                             \* guard:D1
    /\ paused' = [paused EXCEPT ![r] = TRUE]
    /\ pc' = [pc EXCEPT ![r] = "window"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, count, hs,
                   req, out, restarts, crashes>>

\* P-SKIP-WINDOW (fixes D1): this rank asked for the pause, and every local request
\* was withdrawn since: nobody is coming, so do not park; wait at the
\* barrier for the peers' windows instead.
SkipWindow(r) ==
    /\ PauseDecided(r)
    /\ count[r] = 0
    /\ obsPause[r]
    /\ pc' = [pc EXCEPT ![r] = "barrier"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-PARK-FOR-PEER: a peer asked for the pause and no local holder is pending: wait,
\* for a bounded time, for the local holder that must come (upstream's rule:
\* every rank pauses).
ParkForPeer(r) ==
    /\ PauseDecided(r)
    /\ count[r] = 0
    /\ ~obsPause[r]
    /\ pc' = [pc EXCEPT ![r] = "peer"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-JOIN-PEER-PAUSE: the local holder came: open the window for it.
JoinPeerPause(r) ==
    /\ pc[r] = "peer"
    /\ count[r] > 0
    /\ paused' = [paused EXCEPT ![r] = TRUE]
    /\ pc' = [pc EXCEPT ![r] = "window"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, count, hs,
                   req, out, restarts, crashes>>

\* P-FAIL-LOOP, a fatal error of rank r's loop: record it, hard-stop, fail what the
\* driver holds, mark the loop stopped.  The group is broken: no further
\* collective is attempted; peers find out by their own collective timeout.
FailLoop(r) ==
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ stop' = [stop EXCEPT ![r] = STOPPED]
    /\ pc' = [pc EXCEPT ![r] = "stopped"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<tpStop, tpPause, obsStop, obsPause, paused, count, hs,
                   restarts, crashes>>

\* P-PEER-PARK-TIMEOUT (fixes D3): no local holder came within the bound.
PeerParkTimeout(r) ==
    /\ pc[r] = "peer"
    /\ count[r] = 0
    /\ FailLoop(r)

\* P-COLLECTIVE-TIMEOUT: a peer never joined the all-reduce or the barrier
\* (it died, exited, or is held in its pause beyond the group timeout).
CollectiveTimeout(r) ==
    /\ pc[r] \in {"reduce", "barrier"}
    /\ \E q \in Ranks : pc[q] # pc[r]
    /\ FailLoop(r)

\* P-CLOSE-WINDOW: the last holder left (paused went FALSE): close the window.
CloseWindow(r) ==
    /\ pc[r] = "window"
    /\ ~paused[r]                                \* guard:exclusion
    /\ pc' = [pc EXCEPT ![r] = "barrier"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-BARRIER: every rank leaves the pause window together.
Barrier ==
    /\ \A r \in Ranks : pc[r] = "barrier"
    /\ pc' = [r \in Ranks |-> "body"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-NO-PAUSE: no pause decided: straight to the body of the iteration.
NoPause(r) ==
    /\ pc[r] = "decided"
    /\ tpStop < HARD_STOP
    /\ ~tpPause
    /\ pc' = [pc EXCEPT ![r] = "body"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-START-STEP: a forward step of the batch.
StartStep(r) ==
    /\ pc[r] = "body"
    /\ HasWork
    /\ pc' = [pc EXCEPT ![r] = "step"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-END-STEP: the step ends; on the driver every request of the batch finishes (one
\* step per request is enough to expose every interleaving that matters).
EndStep(r) ==
    /\ pc[r] = "step"
    /\ pc' = [pc EXCEPT ![r] = "read"]
    /\ IF r = Driver
       THEN /\ req' = [i \in Requests |-> IF req[i] = "active" THEN "done" ELSE req[i]]
            /\ out' = [i \in Requests |-> IF req[i] = "active" THEN out[i] + 1 ELSE out[i]]
       ELSE UNCHANGED <<req, out>>
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, restarts, crashes>>

\* P-IDLE: nothing to do and no stop: wait for work (the wake-up event), go round.
Idle(r) ==
    /\ pc[r] = "body"
    /\ ~HasWork
    /\ tpStop = DONT_STOP
    /\ pc' = [pc EXCEPT ![r] = "read"]
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts, crashes>>

\* P-EXIT-LOOP: a hard stop exits before any pause window; a flush stop exits
\* once nothing is left to generate.  Whatever remains fails; mark_as_stopped.
ExitLoop(r) ==
    /\ \/ pc[r] = "decided" /\ tpStop = HARD_STOP
       \/ pc[r] = "body" /\ tpStop = FLUSH_AND_STOP /\ ~HasWork
    /\ stop' = [stop EXCEPT ![r] = STOPPED]
    /\ pc' = [pc EXCEPT ![r] = "stopped"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<tpStop, tpPause, obsStop, obsPause, fatal, paused, count,
                   hs, restarts, crashes>>

-----------------------------------------------------------------------------
(* Holders of rank RankOf[h].                                              *)

\* P-REQUEST-PAUSE: ask for a pause.  Refused at once (a RuntimeError, no state
\* change) when the loop is not running, is hard-stopping or has failed.
RequestPause(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "idle"
    /\ Live(r)
    /\ stop[r] < HARD_STOP
    /\ ~fatal[r]
    /\ hs' = [hs EXCEPT ![h] = "waiting"]
    /\ count' = [count EXCEPT ![r] = count[r] + 1]
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   req, out, restarts, crashes>>

\* P-ENTER-PAUSE: the window of the holder's rank is open (a holder arriving on an
\* already paused loop enters directly).
EnterPause(h) ==
    /\ hs[h] = "waiting"
    /\ paused[RankOf[h]]
    /\ pc[RankOf[h]] # "dead"
    /\ hs' = [hs EXCEPT ![h] = "inside"]
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, req, out, restarts, crashes>>

\* P-LEAVE-PAUSE: release_pause by a holder that is inside.
LeavePause(h) ==
    /\ hs[h] = "inside"
    /\ pc[RankOf[h]] # "dead"
    /\ Drop(h)
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, req,
                   out, restarts, crashes>>

\* P-PAUSE-FAILS: the loop is gone before the window opened: the waiting holder
\* raises RuntimeError (chaining the fatal error) and its request is dropped.
PauseFails(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "waiting"
    /\ ~paused[r]
    /\ stop[r] = STOPPED \/ fatal[r]
    /\ pc[r] # "dead"
    /\ Drop(h)
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, req,
                   out, restarts, crashes>>

\* P-INTERRUPT: a waiting holder is interrupted (SIGINT).
Interrupt(h) ==
    /\ "interrupt" \in Faults
    /\ hs[h] = "waiting"
    /\ pc[RankOf[h]] # "dead"
    /\ Drop(h)
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, req,
                   out, restarts, crashes>>

\* P-PAUSE-TIMEOUT: a waiting holder's pause(timeout=...) runs out.
PauseTimeout(h) ==
    /\ "timeout" \in Faults
    /\ hs[h] = "waiting"
    /\ pc[RankOf[h]] # "dead"
    /\ Drop(h)
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, req,
                   out, restarts, crashes>>

-----------------------------------------------------------------------------
(* Stoppers, the environment, requests.                                    *)

\* P-REQUEST-STOP: flush or hard stop asked on rank r; takes effect at the next
\* all-reduce.  The status only grows.
RequestStop(r, s) ==
    /\ "stop" \in Faults
    /\ Live(r)
    /\ stop[r] < s
    /\ stop' = [stop EXCEPT ![r] = IF s >= tpStop THEN s ELSE tpStop]
    /\ UNCHANGED <<pc, tpStop, tpPause, obsStop, obsPause, fatal, paused, count,
                   hs, req, out, restarts, crashes>>

\* P-FATAL-ERROR: an exception in the forward step.  As in transformers: request
\* a hard stop, fail what remains, record the error, and join the group's
\* next all-reduce with HARD_STOP so every rank stops.
FatalError(r) ==
    /\ "error" \in Faults
    /\ pc[r] = "step"
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ stop' = [stop EXCEPT ![r] = HARD_STOP]
    /\ obsStop' = [obsStop EXCEPT ![r] = HARD_STOP]
    /\ obsPause' = [obsPause EXCEPT ![r] = FALSE]
    /\ pc' = [pc EXCEPT ![r] = "reduce"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<tpStop, tpPause, paused, count, hs, restarts, crashes>>

\* P-CRASH: rank r's process dies (its holders with it).
Crash(r) ==
    /\ "crash" \in Faults
    /\ crashes = 0
    /\ Live(r)
    /\ pc' = [pc EXCEPT ![r] = "dead"]
    /\ crashes' = crashes + 1
    /\ UNCHANGED <<stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, req, out, restarts>>

\* P-RESTART (clear()): every loop has stopped and no holder is waiting or inside:
\* clear the statuses and start the loops again.
Restart ==
    /\ restarts < MaxRestarts
    /\ \A r \in Ranks : pc[r] = "stopped"
    /\ \A h \in Holders : hs[h] = "idle"
    /\ pc' = [r \in Ranks |-> "read"]
    /\ stop' = [r \in Ranks |-> DONT_STOP]
    /\ tpStop' = DONT_STOP
    /\ tpPause' = FALSE
    /\ obsStop' = [r \in Ranks |-> DONT_STOP]
    /\ obsPause' = [r \in Ranks |-> FALSE]
    /\ fatal' = [r \in Ranks |-> FALSE]
    /\ paused' = [r \in Ranks |-> FALSE]
    /\ restarts' = restarts + 1
    /\ UNCHANGED <<count, hs, req, out, crashes>>

Accepting == Live(Driver) /\ stop[Driver] = DONT_STOP /\ ~fatal[Driver]

\* P-SUBMIT: the check that the loop accepts requests and the enqueue are
\* one atomic step: a request is either queued or rejected to its caller.
Submit(i) ==
    /\ req[i] = "new"
    /\ req' = [req EXCEPT ![i] = IF Accepting THEN "queued" ELSE "rejected"]
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, out, restarts, crashes>>

\* P-DELIVER: the terminal output reaches the caller.
Deliver(i) ==
    /\ req[i] = "done"
    /\ pc[Driver] # "dead"
    /\ req' = [req EXCEPT ![i] = "delivered"]
    /\ UNCHANGED <<pc, stop, tpStop, tpPause, obsStop, obsPause, fatal, paused,
                   count, hs, out, restarts, crashes>>

\* P-TERMINATED: every loop has ended for good: the behaviour may stutter.
Terminated ==
    /\ \A r \in Ranks : pc[r] \in {"stopped", "dead"}
    /\ UNCHANGED vars

-----------------------------------------------------------------------------

LoopAction(r) ==
    \/ Observe(r) \/ OpenWindow(r) \/ SkipWindow(r) \/ ParkForPeer(r)
    \/ JoinPeerPause(r) \/ PeerParkTimeout(r) \/ CollectiveTimeout(r)
    \/ CloseWindow(r) \/ NoPause(r) \/ StartStep(r) \/ EndStep(r) \/ Idle(r)
    \/ ExitLoop(r)

HolderWakes(h) == EnterPause(h) \/ PauseFails(h)

Next ==
    \/ \E r \in Ranks : LoopAction(r)
    \/ AllReduce \/ Barrier
    \/ \E h \in Holders :
          RequestPause(h) \/ HolderWakes(h) \/ LeavePause(h)
          \/ Interrupt(h) \/ PauseTimeout(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : RequestStop(r, s)
    \/ \E r \in Ranks : FatalError(r) \/ Crash(r)
    \/ Restart
    \/ \E i \in Requests : Submit(i) \/ Deliver(i)
    \/ Terminated

\* Fairness for the system only: loops, collectives, holders waking up,
\* delivery.  Holders' own choices (pause, leave), interrupts, timeouts of
\* pause(timeout=...), errors, crashes, stops and submissions get none.
Fairness ==
    /\ \A r \in Ranks : WF_vars(LoopAction(r))
    /\ WF_vars(AllReduce)
    /\ WF_vars(Barrier)
    /\ \A h \in Holders : SF_vars(HolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety.                                                                 *)

\* R-EXCLUSION: no forward step runs on any rank while a holder is inside.
ExclusionInv == AnyInside => \A r \in Ranks : pc[r] # "step"

\* R-SAME-WINDOW: a holder is inside only while its own window is open and
\* every live rank of the group is parked between the pause decision and
\* the barrier; a window is open only while its loop is parked in it.
SameWindowInv ==
    /\ \A r \in Ranks : paused[r] => pc[r] \in {"window", "dead"}
    /\ \A h \in Holders :
          (hs[h] = "inside" /\ pc[RankOf[h]] # "dead") =>
              /\ paused[RankOf[h]]
              /\ pc[RankOf[h]] = "window"
              /\ \A q \in Ranks :
                    Live(q) => pc[q] \in {"decided", "window", "peer", "barrier"}

\* R-COUNTS: the count is never negative and is exactly the holders waiting
\* or inside; an open window always has a holder to close it.
CountsInv ==
    \A r \in Ranks :
        /\ count[r] >= 0
        /\ count[r] = Cardinality({h \in HoldersOf(r) : hs[h] # "idle"})
        /\ paused[r] => count[r] > 0

\* R-NOTHING-LOST-ONCE: at most one terminal output per request,
\* and a request counted as done or delivered has exactly one.
NothingLostInv ==
    \A i \in Requests :
        /\ out[i] <= 1
        /\ req[i] \in {"done", "delivered"} => out[i] = 1
        /\ req[i] \in {"new", "queued", "active", "rejected"} => out[i] = 0

\* R-MONOTONE-STOP: stop statuses only grow, except through Restart.
MonotoneStopInv ==
    [][restarts' # restarts \/
       (/\ \A r \in Ranks : stop'[r] >= stop[r]
        /\ tpStop' >= tpStop)]_vars

-----------------------------------------------------------------------------
(* Liveness, under Fairness.                                               *)

\* No holder keeps its pause forever: from some point on nobody is inside.
\* A holder that never leaves keeps its rank parked, by design (R-RESUME
\* starts from the last holder out), so the properties that need the loop
\* to run assume it.
HoldersLeave == <>[](~AnyInside)

\* R-PAUSE-RETURNS: every pause() call enters or raises; it never hangs
\* (D1, D3).  Holders of a dead rank died with it.
PauseReturnsProp ==
    \A h \in Holders :
        (hs[h] = "waiting") ~> (hs[h] # "waiting" \/ pc[RankOf[h]] = "dead")

\* R-RESUME: once no holder of the rank waits or is inside, a parked loop
\* resumes or stops.
ResumeProp ==
    \A r \in Ranks :
        (pc[r] = "window" /\ count[r] = 0) ~> (pc[r] \notin {"window", "barrier"})

\* R-STOP-RETURNS: a stop completes unless some holder keeps its pause
\* forever.
StopReturnsProp ==
    HoldersLeave =>
        \A r \in Ranks :
            (stop[r] \in {FLUSH_AND_STOP, HARD_STOP}) ~> (pc[r] \in {"stopped", "dead"})

\* R-PEER-BOUNDED (D3): a rank parked for a peer's pause leaves the park.
PeerParkBoundedProp ==
    \A r \in Ranks : (pc[r] = "peer") ~> (pc[r] # "peer")

\* R-FATAL-STOPS-GROUP: after a fatal error on one rank, the whole group
\* stops (with the error) rather than hanging.
FatalStopsGroupProp ==
    HoldersLeave =>
    \A r \in Ranks :
        fatal[r] ~> (\A q \in Ranks : pc[q] \in {"stopped", "dead"})

\* R-NOTHING-LOST-DELIVERED: every accepted request is delivered,
\* unless the driver process itself died (and its callers with it).
NothingLostProp ==
    HoldersLeave =>
    \A i \in Requests :
        (req[i] \in {"queued", "active", "done"})
            ~> (req[i] = "delivered" \/ pc[Driver] = "dead")

=============================================================================
