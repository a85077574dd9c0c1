--------------------------- MODULE PauseProtocol ---------------------------
(***************************************************************************)
(* cbpause: pausing, stopping and failing a continuous-batching loop,      *)
(* under tensor parallelism.  The prose twin of this module is             *)
(* spec/PROTOCOL.md; every action here has a requirement of the same name  *)
(* there (P-...), and a Python function of the same name in snake case in  *)
(* src/cbpause/core/transitions.py (the name table of spec/PROTOCOL.md,    *)
(* section 8, lists them all).                                             *)
(*                                                                         *)
(* One loop per rank runs the iteration of transformers' continuous        *)
(* batching:                                                               *)
(*                                                                         *)
(*   read -> reduce -> decided -> [window | peer] -> barrier -> body       *)
(*        -> step -> read ...                                              *)
(*                                                                         *)
(* Requests follow the driver's path through it: submitted to its queue,   *)
(* drained at Observe (then in hand: in no queue and no scheduler), carried *)
(* to every rank by the payload broadcast and admitted to the scheduler    *)
(* (Broadcast, before any step of the body), finished by a forward step or *)
(* failed, delivered to their caller.                                      *)
(*                                                                         *)
(* Observe reads the local stop status and whether a local pause is        *)
(* pending; AllReduce is the MAX all-reduce of the group                   *)
(* (DistributedHelper.tp_all_reduce_state); the pause window and the       *)
(* barrier follow; then the forward step.  Holders are threads that pause  *)
(* the loop of their rank.  The environment interrupts waiting holders,    *)
(* injects fatal errors into the forward step, kills ranks, asks for stops *)
(* and restarts the group; none of that is fair, and none of it is bounded *)
(* here: the model wrappers (MC*.tla) set the budgets.                     *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    Ranks,        \* a set of integers; the smallest is the TP driver
    Holders,      \* holder threads
    RankOf,       \* [Holders -> Ranks]: the rank whose loop a holder pauses
    Requests,     \* generation requests, submitted to the driver
    Modes         \* the pause modes holders may ask for: a subset of AllModes

ASSUME RankOf \in [Holders -> Ranks]

\* Pause modes (R-MODES), in the order in which they combine: the group's
\* window takes the strongest mode asked (a MAX, like the pause request it
\* rides on).  0 is "no pause".
KEEP == 1      \* in-flight requests keep their KV and go on after the resume
RETRACT == 2   \* their KV is freed; they are prefilled again after the resume
DRAIN == 3     \* no request is admitted; the window opens once the batch is empty
ABORT == 4     \* at the decision, every request the driver holds ends (aborted)
AllModes == KEEP..ABORT
ASSUME Modes \subseteq AllModes /\ Modes # {}

\* Stop statuses (transformers' BackgroundThreadStatus constants).
DONT_STOP == 0
FLUSH_AND_STOP == 1
HARD_STOP == 2
STOPPED == 3
StopStatuses == DONT_STOP..STOPPED

Phases == {"read", "reduce", "decided", "window", "peer", "barrier",
           "body", "step", "stopped", "dead"}
\* "dead": the holder's thread ended while it waited or was inside, without
\* leaving; its count stays until the protocol notices (ReleaseDeadHolder).
\* "queued": it asked while its rank's window was closing, and waits, not
\* counted, for that window to close: the Drop that closes it makes every
\* queued holder of the rank waiting (QueuePause, R-WINDOW-CLOSES).
HolderStates == {"idle", "queued", "waiting", "inside", "dead"}
\* "drained": taken from the driver's queue at Observe and in hand until the
\* broadcast admits it to every rank's scheduler: the exit path, which fails
\* the queue and the scheduler, cannot see it (D5, issue 24).  In the
\* scheduler a request is "waiting" (transformers' waiting_requests: admitted,
\* never stepped) until its first forward step makes it "active"
\* (active_requests, in flight: what a drain waits for); a later step ends it.
RequestStates == {"new", "queued", "drained", "waiting", "active", "done", "delivered", "rejected"}

Driver == CHOOSE r \in Ranks : \A q \in Ranks : r <= q

Max(S) == CHOOSE m \in S : \A x \in S : x <= m

VARIABLES
    \* The loop of each rank.
    phase,        \* [Ranks -> Phases]: where each rank's loop is
    localStatus,  \* [Ranks -> StopStatuses]: the stop status asked on the rank
    obsStatus,    \* [Ranks -> StopStatuses]: what the rank sent to the all-reduce
    obsPause,     \* [Ranks -> 0..ABORT]: the pause request it sent (the strongest
                  \* mode of its holders; 0: none)
    fatal,        \* [Ranks -> BOOLEAN]: a fatal error is recorded
    draining,     \* [Ranks -> BOOLEAN]: the last all-reduce decided a drain and the
                  \* batch had work: step it, admit no request, open no window
    \* The group.
    tpStatus,     \* the stop status agreed by the last all-reduce
    tpPause,      \* its pause decision: the strongest mode asked, 0 for none
    \* The holders, and what they share with the loop of their rank.
    hs,           \* [Holders -> HolderStates]
    hmode,        \* [Holders -> 0..ABORT]: the mode a holder asked (0 while idle)
    count,        \* [Ranks -> Int]: holders of the rank waiting or inside (or dead there)
    paused,       \* [Ranks -> BOOLEAN]: the pause window is open to holders
    closing,      \* [Ranks -> BOOLEAN]: the open window admits no newcomer: a holder
                  \* has left it or given up on it (R-WINDOW-CLOSES); it closes
                  \* once those it admitted are out
    \* The requests.
    req,          \* [Requests -> RequestStates]
    out,          \* [Requests -> Nat]: terminal outputs produced per request
    \* History: how many times the group was cleared and restarted.
    restarts

loopVars == <<phase, localStatus, obsStatus, obsPause, fatal, draining>>
groupVars == <<tpStatus, tpPause>>
holderVars == <<hs, hmode, count, paused, closing>>
requestVars == <<req, out>>
vars == <<loopVars, groupVars, holderVars, requestVars, restarts>>

LoopTypeOK ==
    /\ phase \in [Ranks -> Phases]
    /\ localStatus \in [Ranks -> StopStatuses]
    /\ obsStatus \in [Ranks -> StopStatuses]
    /\ obsPause \in [Ranks -> 0..ABORT]
    /\ fatal \in [Ranks -> BOOLEAN]
    /\ draining \in [Ranks -> BOOLEAN]

GroupTypeOK ==
    /\ tpStatus \in StopStatuses
    /\ tpPause \in 0..ABORT

HolderTypeOK ==
    /\ hs \in [Holders -> HolderStates]
    /\ hmode \in [Holders -> 0..ABORT]
    /\ \A h \in Holders : (hmode[h] = 0) <=> (hs[h] = "idle")
    /\ count \in [Ranks -> Int]
    /\ paused \in [Ranks -> BOOLEAN]
    /\ closing \in [Ranks -> BOOLEAN]

RequestTypeOK ==
    /\ req \in [Requests -> RequestStates]
    /\ out \in [Requests -> Nat]

\* R-TYPE.
TypeOK ==
    /\ LoopTypeOK
    /\ GroupTypeOK
    /\ HolderTypeOK
    /\ RequestTypeOK
    /\ restarts \in Nat

HoldersOf(r) == {h \in Holders : RankOf[h] = r}
\* Holder h is one its rank's count has: waiting, inside, or dead there.
Counted(h) == hs[h] \notin {"idle", "queued"}
Queued(r) == {h \in HoldersOf(r) : hs[h] = "queued"}
LivePhase(ph) == ph \notin {"stopped", "dead"}
Live(r) == LivePhase(phase[r])
AnyInside == \E h \in Holders : hs[h] = "inside" /\ phase[RankOf[h]] # "dead"
\* A drain that found work holds admission (R-MODES): the scheduler takes no
\* new request into the batch, and only the requests in flight step
\* (upstream.hold_admission); the driver still takes requests from its queue
\* at Observe, and they wait in the scheduler.
Admits == ~draining[Driver]
\* Request q is one the scheduler may step (TracePauseProtocol's PeerWork
\* reads it per request).
Workable(q) == req[q] = "active" \/ (req[q] = "waiting" /\ Admits)
\* The scheduler has requests it may step: a forward step has something to do.
HasWork == \E q \in Requests : Workable(q)
\* Requests in flight: stepped at least once, not ended (modes.busy).
InFlight == \E i \in Requests : req[i] = "active"
\* The group's payload: requests the driver drained and the broadcast has not
\* carried yet.  The all-reduce tells every rank its size, so every rank
\* takes part in the broadcast before any step of its body.
InHand == \E i \in Requests : req[i] = "drained"
\* The payload of a rank's iteration is still to be broadcast: requests are in
\* hand and the driver has not gone on to its next iteration.  Once it has (it
\* drains the next payload at its Observe), a peer still in the body of the
\* iteration before, whose all-reduce agreed no payload or whose broadcast is
\* done, steps or idles on: the next payload is not its iteration's (a real
\* TP=2 trace showed that interleaving; the model had the peer time out
\* instead, issue 38).
PayloadPending == InHand /\ phase[Driver] \notin {"read", "reduce"}

\* The holders of rank r that wait, are inside or died there, and whose mode
\* the group's decision covers: those the window is for.  A holder that asked
\* for a stronger mode than the decision waits for the next window.
Pending(r) == {h \in HoldersOf(r) : Counted(h) /\ hmode[h] <= tpPause}

\* The pause request rank r sends: the strongest mode of its holders.
Asked(r) == Max({hmode[h] : h \in HoldersOf(r)} \cup {0})

\* The loop of rank r moves to phase p; nothing else of the loop changes.
GoTo(r, p) ==
    /\ phase' = [phase EXCEPT ![r] = p]
    /\ UNCHANGED <<localStatus, obsStatus, obsPause, fatal, draining>>

\* A step of the loop of rank r that changes its phase only.
Move(r, p) ==
    /\ GoTo(r, p)
    /\ UNCHANGED <<groupVars, holderVars, requestVars, restarts>>

\* What the driver holds: its queue, its hand (drained, not admitted yet) and
\* its scheduler.
Held == {"queued", "drained", "waiting", "active"}

\* Every request the driver still holds gets its terminal (failed) output.
FailRemaining(r) ==
    IF r = Driver
    THEN /\ req' = [i \in Requests |-> IF req[i] \in Held THEN "done" ELSE req[i]]
         /\ out' = [i \in Requests |-> IF req[i] \in Held THEN out[i] + 1 ELSE out[i]]
    ELSE UNCHANGED requestVars

\* A holder stops waiting or holding: the count drops, and the last one out
\* closes the window (transformers' _drop_pause_request).  A window that stays
\* open is closing from then on: it admits no newcomer (R-WINDOW-CLOSES),
\* whether the holder left it, gave up waiting (a holder that asks and gives up
\* again and again could otherwise hold it open as well as one inside), or died.
\* A closed window is not closing, and the holders queued at it (QueuePause)
\* wait from then on, counted, first: before any holder that asks later.
Drop(h) ==
    LET r == RankOf[h]
        open == Pending(r) \ {h} # {} /\ paused[r]
        admitted == IF open THEN {} ELSE Queued(r)
    IN
    /\ hs' = [x \in Holders |-> IF x = h THEN "idle" ELSE IF x \in admitted THEN "waiting" ELSE hs[x]]
    /\ hmode' = [hmode EXCEPT ![h] = 0]
    /\ count' = [count EXCEPT ![r] = count[r] - 1 + Cardinality(admitted)]
    /\ paused' = [paused EXCEPT ![r] = open]
    /\ closing' = [closing EXCEPT ![r] = open]
    /\ UNCHANGED <<loopVars, groupVars, requestVars, restarts>>

Init ==
    /\ phase = [r \in Ranks |-> "read"]
    /\ localStatus = [r \in Ranks |-> DONT_STOP]
    /\ obsStatus = [r \in Ranks |-> DONT_STOP]
    /\ obsPause = [r \in Ranks |-> 0]
    /\ fatal = [r \in Ranks |-> FALSE]
    /\ draining = [r \in Ranks |-> FALSE]
    /\ tpStatus = DONT_STOP
    /\ tpPause = 0
    /\ hs = [h \in Holders |-> "idle"]
    /\ hmode = [h \in Holders |-> 0]
    /\ count = [r \in Ranks |-> 0]
    /\ paused = [r \in Ranks |-> FALSE]
    /\ closing = [r \in Ranks |-> FALSE]
    /\ req = [i \in Requests |-> "new"]
    /\ out = [i \in Requests |-> 0]
    /\ restarts = 0

-----------------------------------------------------------------------------
(* The loop of rank r.                                                     *)

\* Observe's step of the loop, without the drain (TracePauseProtocol takes the
\* drain from the real loop's records of it).
ObserveLoop(r) ==
    /\ phase[r] = "read"
    /\ phase' = [phase EXCEPT ![r] = "reduce"]
    /\ obsStatus' = [obsStatus EXCEPT ![r] = localStatus[r]]
    /\ obsPause' = [obsPause EXCEPT ![r] = Asked(r)]
    /\ UNCHANGED <<localStatus, fatal, draining, groupVars, holderVars, restarts>>

\* P-OBSERVE: read the local stop status and the pending pause request (its
\* mode) for the all-reduce; the driver drains its request queue into its
\* hand (the payload), in a drain too (the scheduler holds them: Admits).
Observe(r) ==
    /\ ObserveLoop(r)
    /\ req' = IF r = Driver
              THEN [i \in Requests |-> IF req[i] = "queued" THEN "drained" ELSE req[i]]
              ELSE req
    /\ UNCHANGED out

\* P-ALL-REDUCE: the MAX all-reduce of stop status and pause request; needs
\* every rank of the group (a dead or exited rank blocks it).  A decision to
\* pause in ABORT (and not to hard-stop) ends every request the driver holds,
\* queued or in the batch (R-MODES): each rank drops its copies of them, at
\* once, before any window opens.
AllReduce ==
    /\ \A r \in Ranks : phase[r] = "reduce"
    /\ LET s == Max({obsStatus[r] : r \in Ranks}) IN
       /\ tpStatus' = s
       /\ localStatus' = [r \in Ranks |-> IF localStatus[r] >= s THEN localStatus[r] ELSE s]
    /\ LET m == Max({obsPause[r] : r \in Ranks}) IN
       /\ tpPause' = m
       \* Every rank reads its own batch at the decision; the batches of a TP
       \* group are copies of the driver's, at the same iteration.
       /\ draining' = [r \in Ranks |-> m = DRAIN /\ InFlight]
    /\ IF Max({obsPause[r] : r \in Ranks}) = ABORT /\ Max({obsStatus[r] : r \in Ranks}) < HARD_STOP
       THEN FailRemaining(Driver)
       ELSE UNCHANGED requestVars
    /\ phase' = [r \in Ranks |-> "decided"]
    \* What was sent is spent; forgetting it keeps the state space small.
    /\ obsStatus' = [r \in Ranks |-> DONT_STOP]
    /\ UNCHANGED <<obsPause, fatal, holderVars, restarts>>

PauseDecided(r) == phase[r] = "decided" /\ tpStatus < HARD_STOP /\ tpPause > 0

\* The loop of rank r opens its pause window and parks in it.
Park(r) ==
    /\ GoTo(r, "window")
    /\ paused' = [paused EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<groupVars, hs, hmode, count, closing, requestVars, restarts>>

\* P-OPEN-WINDOW: the group decided to pause and a local holder is pending: open
\* the window and park until the last holder leaves.
OpenWindow(r) ==
    /\ PauseDecided(r)
    /\ ~draining[r]
    /\ Pending(r) # {}                          \* guard:D1
    /\ Park(r)

\* P-DRAIN-FIRST: the group decided to drain and the batch had work: no
\* window yet; step the batch, admitting no new request, and ask again.
DrainFirst(r) ==
    /\ PauseDecided(r)
    /\ draining[r]
    /\ Move(r, "body")

\* P-SKIP-WINDOW (fixes D1): no local holder is pending and none is coming:
\* this rank asked for the pause and every local request was withdrawn since,
\* or a stop was asked on this rank (it admits no new pause).  Do not park;
\* wait at the barrier for the peers' windows instead.
SkipWindow(r) ==
    /\ PauseDecided(r)
    /\ ~draining[r]
    /\ Pending(r) = {}
    /\ obsPause[r] > 0 \/ localStatus[r] # DONT_STOP
    /\ Move(r, "barrier")

\* P-PARK-FOR-PEER: a peer asked for the pause and no local holder is pending: wait,
\* for a bounded time, for the local holder that must come (upstream's rule:
\* every rank pauses).
ParkForPeer(r) ==
    /\ PauseDecided(r)
    /\ ~draining[r]
    /\ Pending(r) = {}
    /\ obsPause[r] = 0
    /\ localStatus[r] = DONT_STOP
    /\ Move(r, "peer")

\* P-JOIN-PEER-PAUSE: the local holder came: open the window for it.
JoinPeerPause(r) ==
    /\ phase[r] = "peer"
    /\ Pending(r) # {}
    /\ Park(r)

\* A fatal error of rank r's loop: record it, hard-stop, fail what the driver
\* holds, mark the loop stopped.  The group is broken: no further collective
\* is attempted; peers find out by their own collective timeout.
Fail(r) ==
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
    /\ phase' = [phase EXCEPT ![r] = "stopped"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<obsStatus, obsPause, draining, groupVars, holderVars, restarts>>

\* P-FAIL-LOOP: the loop's thread fails outside a forward step and outside a
\* collective (an exception in its own code around the pause window, or one
\* that ends the thread): Fail.  Not while a holder is inside: the loop then
\* waits in its window and runs no code of its own.
FailLoop(r) ==
    /\ Live(r)
    /\ phase[r] # "window"
    /\ Fail(r)

\* P-PEER-PARK-TIMEOUT (fixes D3): no local holder came within the bound.
PeerParkTimeout(r) ==
    /\ phase[r] = "peer"
    /\ Pending(r) = {}
    /\ Fail(r)

\* P-COLLECTIVE-TIMEOUT: a peer never joined the all-reduce, the barrier or the
\* payload broadcast (it died, exited, or is held in its pause beyond the
\* group timeout).  What the driver holds fails, its hand included.
CollectiveTimeout(r) ==
    /\ \/ phase[r] \in {"reduce", "barrier"}
       \/ phase[r] = "body" /\ PayloadPending
    /\ \E q \in Ranks : phase[q] # phase[r]
    /\ Fail(r)

\* P-CLOSE-WINDOW: the last holder left (paused went FALSE): close the window.
CloseWindow(r) ==
    /\ phase[r] = "window"
    /\ ~paused[r]                                \* guard:exclusion
    /\ Move(r, "barrier")

\* P-BARRIER: every rank leaves the pause window together.
Barrier ==
    /\ \A r \in Ranks : phase[r] = "barrier"
    /\ phase' = [r \in Ranks |-> "body"]
    /\ UNCHANGED <<localStatus, obsStatus, obsPause, fatal, draining, groupVars,
                   holderVars, requestVars, restarts>>

\* P-NO-PAUSE: no pause decided: straight to the body of the iteration.
NoPause(r) ==
    /\ phase[r] = "decided"
    /\ tpStatus < HARD_STOP
    /\ tpPause = 0
    /\ Move(r, "body")

\* P-BROADCAST: the payload broadcast, a collective of every rank (gloo's
\* broadcast_object_list under TP), carries what the driver drained to every
\* rank, and each rank admits it to its scheduler.  It fails as a collective
\* does (CollectiveTimeout), or with the loop (FailLoop, RecordFatalError,
\* Crash); whatever fails in between fails the requests in hand.
Broadcast ==
    /\ InHand
    /\ \A r \in Ranks : phase[r] = "body"
    /\ req' = [i \in Requests |-> IF req[i] = "drained" THEN "waiting" ELSE req[i]]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* P-START-STEP: a forward step of the batch.  Its guard takes work, whether
\* the batch has work: HasWork here; TracePauseProtocol widens it to a flush
\* loop's empty step.
CanStartStep(r, work) ==
    /\ phase[r] = "body"
    /\ ~PayloadPending
    /\ work

StartStep(r) ==
    /\ CanStartStep(r, HasWork)
    /\ Move(r, "step")

\* EndStep's step of the loop, without the requests' (TracePauseProtocol takes
\* those from the real loop's records of its outputs).
EndStepLoop(r) ==
    /\ phase[r] = "step"
    /\ GoTo(r, "read")
    /\ UNCHANGED <<groupVars, holderVars, restarts>>

\* P-END-STEP: the step ends; on the driver a request's first step puts it in
\* flight (waiting -> active, unless a drain holds admission: Admits) and its
\* second ends it (two steps per request
\* are enough to expose every interleaving that matters: a request in flight
\* at a decision, which a drain waits for, and one that ends).
EndStep(r) ==
    /\ EndStepLoop(r)
    /\ IF r = Driver
       THEN /\ req' = [i \in Requests |-> CASE req[i] = "active" -> "done"
                                            [] req[i] = "waiting" /\ Admits -> "active"
                                            [] OTHER -> req[i]]
            /\ out' = [i \in Requests |-> IF req[i] = "active" THEN out[i] + 1 ELSE out[i]]
       ELSE UNCHANGED requestVars

\* P-IDLE: nothing to do and no stop: wait for work (the wake-up event), go round.
\* The guards of P-IDLE and P-EXIT-LOOP take work, whether the rank's batch
\* has work: HasWork here; TracePauseProtocol gives a peer its own view.
CanIdle(r, work) ==
    /\ phase[r] = "body"
    /\ ~PayloadPending
    /\ ~work
    /\ tpStatus = DONT_STOP

Idle(r) ==
    /\ CanIdle(r, HasWork)
    /\ Move(r, "read")

\* P-EXIT-LOOP: a hard stop exits before any pause window; a flush stop exits
\* once nothing is left to generate.  Whatever remains fails; mark_as_stopped.
CanExitLoop(r, work) ==
    \/ phase[r] = "decided" /\ tpStatus = HARD_STOP
    \/ phase[r] = "body" /\ tpStatus = FLUSH_AND_STOP /\ ~PayloadPending /\ ~work

Exit(r) ==
    /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
    /\ phase' = [phase EXCEPT ![r] = "stopped"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<obsStatus, obsPause, fatal, draining, groupVars, holderVars, restarts>>

ExitLoop(r) ==
    /\ CanExitLoop(r, HasWork)
    /\ Exit(r)

-----------------------------------------------------------------------------
(* Holders of rank RankOf[h].                                              *)

\* The guard of P-REQUEST-PAUSE on what a rank shows: its phase ph, its stop
\* status ls and its fatal flag f.  Refused at once (a RuntimeError, no state
\* change) when the loop is not running, has failed, or a stop was asked on
\* this rank or agreed by the group (R-STOP-RETURNS: holders that keep pausing
\* could otherwise keep a flush stop from ever completing: D7).  The one
\* definition of the guard: TracePauseProtocol evaluates it on the view a
\* rank's object showed, which may lag a group step (Python:
\* transitions.can_request_pause).
CanRequestPause(ph, ls, f) ==
    /\ LivePhase(ph)
    /\ ls = DONT_STOP                            \* guard:D7
    /\ ~f

\* What P-REQUEST-PAUSE does once allowed: holder h waits, in mode m.
AskPause(h, m) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "idle"
    /\ m \in Modes
    /\ hs' = [hs EXCEPT ![h] = "waiting"]
    /\ hmode' = [hmode EXCEPT ![h] = m]
    /\ count' = [count EXCEPT ![r] = count[r] + 1]
    /\ UNCHANGED <<loopVars, groupVars, paused, closing, requestVars, restarts>>

\* P-REQUEST-PAUSE: ask for a pause, in one of the Modes.  A holder that
\* arrives while its rank's window is closing queues instead (QueuePause).
RequestPause(h) ==
    LET r == RankOf[h] IN
    /\ CanRequestPause(phase[r], localStatus[r], fatal[r])
    /\ ~closing[r]                               \* guard:window-closes
    /\ \E m \in Modes : AskPause(h, m)

\* What P-QUEUE-PAUSE does once allowed: holder h is queued, in mode m.
Queue(h, m) ==
    /\ hs[h] = "idle"
    /\ m \in Modes
    /\ hs' = [hs EXCEPT ![h] = "queued"]
    /\ hmode' = [hmode EXCEPT ![h] = m]
    /\ UNCHANGED <<loopVars, groupVars, count, paused, closing, requestVars, restarts>>

\* P-QUEUE-PAUSE: a holder that asks while its rank's window is closing is
\* queued (R-WINDOW-CLOSES): not counted, it cannot keep the window open;
\* the Drop that closes the window makes it waiting, before any holder that
\* asks after the close.  First come, first served: its entry needs no
\* fairness of its own (weak fairness of the holders' wake-up, HolderWakes,
\* then takes it in), where asking again after the close would need strong
\* fairness (issue 40, point 3).
QueuePause(h) ==
    LET r == RankOf[h] IN
    /\ CanRequestPause(phase[r], localStatus[r], fatal[r])
    /\ closing[r]
    /\ \E m \in Modes : Queue(h, m)

\* P-ENTER-PAUSE: the window of the holder's rank is open, in a mode at least
\* as strong as the holder's (a holder arriving on an already paused loop
\* enters directly; one that asked for more waits for the next window, so
\* that no holder inside sees the mode change under it).
EnterPause(h) ==
    /\ hs[h] = "waiting"
    /\ paused[RankOf[h]]
    /\ hmode[h] <= tpPause
    /\ phase[RankOf[h]] # "dead"
    /\ hs' = [hs EXCEPT ![h] = "inside"]
    /\ UNCHANGED <<loopVars, groupVars, hmode, count, paused, closing, requestVars, restarts>>

\* P-LEAVE-PAUSE: release_pause by a holder that is inside.
LeavePause(h) ==
    /\ hs[h] = "inside"
    /\ phase[RankOf[h]] # "dead"
    /\ Drop(h)

\* P-PAUSE-FAILS: the loop is gone before the window opened: the waiting holder
\* raises RuntimeError (chaining the fatal error) and its request is dropped.
PauseFails(h) ==
    LET r == RankOf[h] IN
    /\ hs[h] = "waiting"
    /\ ~paused[r]
    /\ localStatus[r] = STOPPED \/ fatal[r]
    /\ phase[r] # "dead"
    /\ Drop(h)

\* P-INTERRUPT: a waiting holder is interrupted (SIGINT).
Interrupt(h) ==
    /\ hs[h] = "waiting"
    /\ phase[RankOf[h]] # "dead"
    /\ Drop(h)

\* P-PAUSE-TIMEOUT: a waiting holder's pause(timeout=...) runs out.
PauseTimeout(h) ==
    /\ hs[h] = "waiting"
    /\ phase[RankOf[h]] # "dead"
    /\ Drop(h)

\* P-LEAVE-QUEUE: a queued holder is interrupted, its timeout runs out, or a
\* stop or a failure refuses it: it leaves the queue, never counted.  (Its
\* thread cannot die there unseen: it waits inside its own call, which
\* withdraws it on the way out.)
LeaveQueue(h) ==
    /\ hs[h] = "queued"
    /\ phase[RankOf[h]] # "dead"
    /\ hs' = [hs EXCEPT ![h] = "idle"]
    /\ hmode' = [hmode EXCEPT ![h] = 0]
    /\ UNCHANGED <<loopVars, groupVars, count, paused, closing, requestVars, restarts>>

\* Holder h's thread may die now: it waits or is inside, on a rank that lives.
HolderMayDie(h) ==
    /\ hs[h] \in {"waiting", "inside"}
    /\ phase[RankOf[h]] # "dead"

\* Where a dead holder's hold is released: by the loop parked in its window,
\* or stepping its batch in a drain (which never parks: issue 26, point 4; no
\* holder is inside then, so the hold was waiting), or by clear() on a
\* stopped loop.
DeadHolderReleasable(h) ==
    phase[RankOf[h]] \in {"window", "stopped"} \/ draining[RankOf[h]]

\* P-HOLDER-DIES: a holder's thread ends while it waits or is inside, without
\* leaving (it returned or was killed with the pause's context manager still
\* referenced).  Nothing else changes: the protocol does not know yet.
HolderDies(h) ==
    /\ HolderMayDie(h)
    /\ hs' = [hs EXCEPT ![h] = "dead"]
    /\ UNCHANGED <<loopVars, groupVars, hmode, count, paused, closing, requestVars, restarts>>

\* P-RELEASE-DEAD-HOLDER: the recovery.  The loop, parked in its window, checks
\* its holders' threads at a short interval and releases the hold of one that
\* died (as LeavePause or Interrupt would); clear() does the same on a stopped
\* loop before it restarts.  A dead holder slot may be taken again by a new
\* thread (RequestPause from "idle").
ReleaseDeadHolder(h) ==
    /\ hs[h] = "dead"
    /\ DeadHolderReleasable(h)
    /\ Drop(h)

-----------------------------------------------------------------------------
(* Stoppers, the environment, requests.                                    *)

\* The guard of P-REQUEST-STOP on what a rank shows (phase ph, stop status ls),
\* for stop status s; like CanRequestPause, read by TracePauseProtocol too.
CanRequestStop(ph, ls, s) ==
    /\ LivePhase(ph)
    /\ ls < s

\* P-REQUEST-STOP: flush or hard stop asked on rank r; takes effect at the next
\* all-reduce.  The status only grows.
RequestStop(r, s) ==
    /\ CanRequestStop(phase[r], localStatus[r], s)
    /\ localStatus' = [localStatus EXCEPT ![r] = IF s >= tpStatus THEN s ELSE tpStatus]
    /\ UNCHANGED <<phase, obsStatus, obsPause, fatal, draining, groupVars, holderVars,
                   requestVars, restarts>>

\* P-RECORD-FATAL-ERROR: an exception in the loop's own code between two
\* iterations' collectives: in the forward step, or before it (preparing the
\* batch, starting the loop).  As in transformers: request a hard stop, fail
\* what remains, record the error, and join the group's next all-reduce with
\* HARD_STOP so every rank stops.
RecordFatalError(r) ==
    /\ phase[r] \in {"read", "body", "step"}
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ localStatus' = [localStatus EXCEPT ![r] = HARD_STOP]
    /\ obsStatus' = [obsStatus EXCEPT ![r] = HARD_STOP]
    /\ obsPause' = [obsPause EXCEPT ![r] = 0]
    /\ phase' = [phase EXCEPT ![r] = "reduce"]
    /\ FailRemaining(r)
    /\ UNCHANGED <<draining, groupVars, holderVars, restarts>>

\* P-CRASH: rank r's process dies (its holders with it).
Crash(r) ==
    /\ Live(r)
    /\ Move(r, "dead")

\* P-RESTART (clear()): every loop has stopped and no holder is waiting or inside:
\* clear the statuses and start the loops again.
Restart ==
    /\ \A r \in Ranks : phase[r] = "stopped"
    /\ \A h \in Holders : hs[h] = "idle"
    /\ phase' = [r \in Ranks |-> "read"]
    /\ localStatus' = [r \in Ranks |-> DONT_STOP]
    /\ obsStatus' = [r \in Ranks |-> DONT_STOP]
    /\ obsPause' = [r \in Ranks |-> 0]
    /\ fatal' = [r \in Ranks |-> FALSE]
    /\ draining' = [r \in Ranks |-> FALSE]
    /\ tpStatus' = DONT_STOP
    /\ tpPause' = 0
    /\ paused' = [r \in Ranks |-> FALSE]
    /\ closing' = [r \in Ranks |-> FALSE]
    /\ restarts' = restarts + 1
    /\ UNCHANGED <<hs, hmode, count, requestVars>>

\* The guard of P-SUBMIT's acceptance on what the driver shows (phase ph, stop
\* status ls, fatal f); read by TracePauseProtocol too (PauseProtocol.submit).
CanSubmit(ph, ls, f) == LivePhase(ph) /\ ls = DONT_STOP /\ ~f

Accepting == CanSubmit(phase[Driver], localStatus[Driver], fatal[Driver])

\* P-SUBMIT: the check that the loop accepts requests and the enqueue are
\* one atomic step: a request is either queued or rejected to its caller.
Submit(i) ==
    /\ req[i] = "new"
    /\ req' = [req EXCEPT ![i] = IF Accepting THEN "queued" ELSE "rejected"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* P-DELIVER: the terminal output reaches the caller.
Deliver(i) ==
    /\ req[i] = "done"
    /\ phase[Driver] # "dead"
    /\ req' = [req EXCEPT ![i] = "delivered"]
    /\ UNCHANGED <<loopVars, groupVars, holderVars, out, restarts>>

\* P-TERMINATED: every loop has ended for good: the behaviour may stutter.
Terminated ==
    /\ \A r \in Ranks : phase[r] \in {"stopped", "dead"}
    /\ UNCHANGED vars

-----------------------------------------------------------------------------

LoopAction(r) ==
    \/ Observe(r) \/ OpenWindow(r) \/ DrainFirst(r) \/ SkipWindow(r) \/ ParkForPeer(r)
    \/ JoinPeerPause(r) \/ PeerParkTimeout(r) \/ CollectiveTimeout(r)
    \/ CloseWindow(r) \/ NoPause(r) \/ StartStep(r) \/ EndStep(r) \/ Idle(r)
    \/ ExitLoop(r)

HolderWakes(h) == EnterPause(h) \/ PauseFails(h)

\* What the loops, the group and the holders do, less the recovery from dead
\* holders (the witness models check that without it the loop stays parked).
SystemNextWithoutRecovery ==
    \/ \E r \in Ranks : LoopAction(r)
    \/ AllReduce \/ Barrier \/ Broadcast
    \/ \E h \in Holders : RequestPause(h) \/ QueuePause(h) \/ HolderWakes(h) \/ LeavePause(h)
    \/ \E i \in Requests : Submit(i) \/ Deliver(i)
    \/ Terminated

SystemNext ==
    \/ SystemNextWithoutRecovery
    \/ \E h \in Holders : ReleaseDeadHolder(h)

\* What the environment does to them.  The model wrappers (MC*.tla) bound
\* each of these with a budget of their own.
EnvironmentNext ==
    \/ \E h \in Holders : Interrupt(h) \/ PauseTimeout(h) \/ LeaveQueue(h) \/ HolderDies(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : RequestStop(r, s)
    \/ \E r \in Ranks : RecordFatalError(r) \/ FailLoop(r) \/ Crash(r)
    \/ Restart

Next == SystemNext \/ EnvironmentNext

\* Fairness for the system only: loops, collectives, holders waking up,
\* delivery.  Holders' own choices (pause, leave), interrupts, timeouts of
\* pause(timeout=...), errors, crashes, stops and submissions get none.
\* spec/PROTOCOL.md, section 4.4, names the code that makes each one true.
\* Weak fairness is enough for a waiting holder: once HolderWakes(h) is
\* enabled it stays enabled until h takes it (its own count keeps the window
\* open; a stopped loop stays stopped while a holder waits).  The recovery
\* is fair where the loop does it, parked in its window (it wakes at least
\* every HOLDER_CHECK_S seconds there); on a stopped loop only clear() does
\* it, and nobody has to call clear().
FairnessWithoutRecovery ==
    /\ \A r \in Ranks : WF_vars(LoopAction(r))
    /\ WF_vars(AllReduce)
    /\ WF_vars(Barrier)
    /\ WF_vars(Broadcast)
    /\ \A h \in Holders : WF_vars(HolderWakes(h))
    /\ \A i \in Requests : WF_vars(Deliver(i))

Fairness ==
    /\ FairnessWithoutRecovery
    /\ \A h \in Holders :
        WF_vars((phase[RankOf[h]] = "window" \/ draining[RankOf[h]]) /\ ReleaseDeadHolder(h))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety.                                                                 *)

\* R-EXCLUSION: no forward step runs on any rank while a holder is inside.
ExclusionInv == AnyInside => \A r \in Ranks : phase[r] # "step"

\* R-SAME-WINDOW: a holder is inside only while its own window is open and
\* every live rank of the group is parked between the pause decision and
\* the barrier; a window is open only while its loop is parked in it.
SameWindowInv ==
    /\ \A r \in Ranks : paused[r] => phase[r] \in {"window", "dead"}
    /\ \A h \in Holders :
          (hs[h] = "inside" /\ phase[RankOf[h]] # "dead") =>
              /\ paused[RankOf[h]]
              /\ phase[RankOf[h]] = "window"
              /\ \A q \in Ranks :
                    Live(q) => phase[q] \in {"decided", "window", "peer", "barrier"}

\* R-COUNTS: the count is never negative and is exactly the holders waiting
\* or inside; an open window always has a holder to close it.
CountsInv ==
    \A r \in Ranks :
        /\ count[r] >= 0
        /\ count[r] = Cardinality({h \in HoldersOf(r) : Counted(h)})
        /\ paused[r] => Pending(r) # {}
        /\ closing[r] => paused[r]
        /\ Queued(r) # {} => closing[r]

\* R-NOTHING-LOST-ONCE: at most one terminal output per request, a request
\* counted as done or delivered has exactly one, and a driver whose loop has
\* stopped holds no request (no accepted request is left behind in a queue, a
\* hand or a batch that nobody will read again: transformers 5.23.0's D5).
NothingLostInv ==
    \A i \in Requests :
        /\ out[i] <= 1
        /\ req[i] \in {"done", "delivered"} => out[i] = 1
        /\ req[i] \in {"new", "rejected"} \cup Held => out[i] = 0
        /\ phase[Driver] = "stopped" => req[i] \notin Held

\* R-MODES: a holder inside asked for a mode no stronger than the window's;
\* in DRAIN and in ABORT no request is in the batch while a holder is inside
\* (in ABORT every request the driver held at the decision got its terminal
\* output first).
ModeInv ==
    /\ \A h \in Holders : hs[h] = "inside" => hmode[h] \in 1..tpPause
    /\ tpPause \in {DRAIN, ABORT} /\ AnyInside => ~InFlight

\* R-MONOTONE-STOP: stop statuses only grow, except through Restart.
MonotoneStopInv ==
    [][restarts' # restarts \/
       (/\ \A r \in Ranks : localStatus'[r] >= localStatus[r]
        /\ tpStatus' >= tpStatus)]_vars

-----------------------------------------------------------------------------
(* Liveness, under Fairness.                                               *)

\* Every holder inside eventually leaves (weak fairness of its LeavePause).  A
\* holder that never leaves keeps its rank parked, by design (R-RESUME starts
\* from the last holder out), so the properties that need the loop to run
\* assume it.  Holders may pause again and again: no new pause is admitted
\* once a stop is asked (RequestPause), so they cannot keep a stop waiting.
HoldersLeave == \A h \in Holders : WF_vars(LeavePause(h))

\* R-WINDOW-CLOSES: holders do not keep a window open for ever between them:
\* every rank is out of its window infinitely often, when each holder leaves
\* (HoldersLeave) and whatever the others do.  Holders whose pauses overlap
\* share one window (R-SAME-WINDOW); once one of them has left (or given up),
\* the window admits no newcomer (closing: RequestPause waits for it to close), so the
\* holders it admitted are finitely many and it closes when they are out.
\* (Before issue 25 this was a premise of NothingLostProp; upstream has no
\* such rule, and two holders taking turns hold its window for ever: D11.)
WindowsClose == \A r \in Ranks : []<>(phase[r] # "window")
WindowsCloseProp == HoldersLeave => WindowsClose

\* R-PAUSE-RETURNS: every pause() call in KEEP, the weakest mode, enters or
\* raises; it never hangs (D1, D3).  Holders of a dead rank died with it.
PauseReturnsProp ==
    \A h \in Holders :
        (hs[h] = "waiting" /\ hmode[h] = KEEP) ~> (hs[h] # "waiting" \/ phase[RankOf[h]] = "dead")

\* R-PAUSE-RETURNS, in every mode: a holder that asked for a stronger mode
\* than the open window's waits for the next window, so for the holders
\* inside to leave (R-MODES); then it enters or raises too.
ModePauseReturnsProp ==
    HoldersLeave =>
    \A h \in Holders :
        (hs[h] = "waiting") ~> (hs[h] # "waiting" \/ phase[RankOf[h]] = "dead")

\* R-WINDOW-CLOSES, first come: a holder that asks while its rank's window is
\* closing (QueuePause) gets in or raises, when each holder leaves
\* (HoldersLeave): the window closes, the Drop that closes it makes the
\* holder waiting, and it takes the next window.  Under weak fairness only:
\* the queued holder needs none of its own (issue 40, point 3).
QueuedEntersProp ==
    HoldersLeave =>
    \A h \in Holders :
        (hs[h] = "queued") ~> (hs[h] \notin {"queued", "waiting"} \/ phase[RankOf[h]] = "dead")

\* R-RESUME: once no live holder of the rank waits or is inside (the others
\* left, or their threads died), a parked loop resumes or stops, unless a
\* new holder comes to pause it again (it may join the open window).
LiveHolderOn(r) == \E h \in HoldersOf(r) : hs[h] \in {"waiting", "inside"}
ResumeProp ==
    \A r \in Ranks :
        (phase[r] = "window" /\ ~LiveHolderOn(r))
            ~> (phase[r] \notin {"window", "barrier"} \/ LiveHolderOn(r))

\* R-STOP-RETURNS: a stop completes unless some holder keeps its pause
\* forever.
StopReturnsProp ==
    HoldersLeave =>
        \A r \in Ranks :
            (localStatus[r] \in {FLUSH_AND_STOP, HARD_STOP}) ~> (phase[r] \in {"stopped", "dead"})

\* R-PEER-BOUNDED (D3): a rank parked for a peer's pause leaves the park.
PeerParkBoundedProp ==
    \A r \in Ranks : (phase[r] = "peer") ~> (phase[r] # "peer")

\* R-FATAL-STOPS-GROUP: after a fatal error on one rank, the whole group
\* stops (with the error) rather than hanging.
FatalStopsGroupProp ==
    HoldersLeave =>
    \A r \in Ranks :
        fatal[r] ~> (\A q \in Ranks : phase[q] \in {"stopped", "dead"})

\* R-NOTHING-LOST-DELIVERED: every accepted request is delivered,
\* unless the driver process itself died (and its callers with it).
NothingLostProp ==
    HoldersLeave =>
    \A i \in Requests :
        (req[i] \in Held \cup {"done"})
            ~> (req[i] = "delivered" \/ phase[Driver] = "dead")

=============================================================================
