-------------------------- MODULE MCPauseProtocol --------------------------
(***************************************************************************)
(* The model wrapper of PauseProtocol (as etcd-io/raft's MCetcdraft.tla    *)
(* and microsoft/CCF's MCccfraft.tla): the budgets of the environment,     *)
(* the holder-to-rank maps a .cfg cannot write, and the witnesses.  Each   *)
(* .cfg picks its constants from here; models.toml lists the models and   *)
(* the result each must give.                                              *)
(*                                                                         *)
(* MCSpec is Spec with every environment action strengthened by its       *)
(* budget, and nothing else: the system's actions and the fairness are     *)
(* PauseProtocol's own.  TLC names each bounded action after its wrapper   *)
(* (MCInterrupt for Interrupt), in counterexamples and in state graphs.    *)
(***************************************************************************)
EXTENDS PauseProtocol, TLC

CONSTANTS
    Faults,       \* subset of {"interrupt", "timeout", "error", "crash", "stop", "death"}
                  \* ("stray", "cancel" and "kill" too, in the upstream models only)
    MaxRestarts   \* how many times the group may be cleared and restarted

ASSUME Faults \subseteq {"interrupt", "timeout", "error", "crash", "stop", "death", "stray", "cancel", "kill"}
ASSUME MaxRestarts \in Nat

\* The environment's actions, each within its budget.  One crash at most
\* per behaviour: a dead rank stays dead, so this is "no rank has died".
MCInterrupt(h) == "interrupt" \in Faults /\ Interrupt(h)
MCPauseTimeout(h) == "timeout" \in Faults /\ PauseTimeout(h)
MCHolderDies(h) == "death" \in Faults /\ HolderDies(h)
\* A queued holder's interrupt or timeout, or a stop or a failure that takes
\* it out of the queue (the code's queued holder leaves on either).
MCLeaveQueue(h) == Faults \cap {"interrupt", "timeout", "stop", "error"} # {} /\ LeaveQueue(h)
MCRequestStop(r, s) == "stop" \in Faults /\ RequestStop(r, s)
MCRecordFatalError(r) == "error" \in Faults /\ RecordFatalError(r)
MCFailLoop(r) == "error" \in Faults /\ FailLoop(r)
MCCrash(r) == "crash" \in Faults /\ (\A q \in Ranks : phase[q] # "dead") /\ Crash(r)
MCRestart == restarts < MaxRestarts /\ Restart

MCEnvironmentNext ==
    \/ \E h \in Holders : MCInterrupt(h) \/ MCPauseTimeout(h) \/ MCLeaveQueue(h) \/ MCHolderDies(h)
    \/ \E r \in Ranks : \E s \in {FLUSH_AND_STOP, HARD_STOP} : MCRequestStop(r, s)
    \/ \E r \in Ranks : MCRecordFatalError(r) \/ MCFailLoop(r) \/ MCCrash(r)
    \/ MCRestart

MCSpec == Init /\ [][SystemNext \/ MCEnvironmentNext]_vars /\ Fairness

\* MCSpec without P-RELEASE-DEAD-HOLDER: the models of it must fail (holders
\* that die leave their loop parked for ever), which shows the fault is real.
MCSpecWithoutRecovery ==
    Init /\ [][SystemNextWithoutRecovery \/ MCEnvironmentNext]_vars /\ FairnessWithoutRecovery

\* cbpause before issue 24: the payload broadcast raised outside the handler
\* that fails the requests in hand, so its failure (a peer died) failed the
\* queue and the scheduler, and lost the hand.  Added beside CollectiveTimeout;
\* the model BroadcastOutside_2r1h must fail NothingLostInv, which shows the
\* model sees a request in transit.
BroadcastFailsOutsideTheHandler(r) ==
    /\ phase[r] = "body" /\ PayloadPending
    /\ \E q \in Ranks : phase[q] # phase[r]
    /\ fatal' = [fatal EXCEPT ![r] = TRUE]
    /\ localStatus' = [localStatus EXCEPT ![r] = STOPPED]
    /\ phase' = [phase EXCEPT ![r] = "stopped"]
    /\ IF r = Driver
       THEN /\ req' = [i \in Requests |-> IF req[i] \in Held \ {"drained"} THEN "done" ELSE req[i]]
            /\ out' = [i \in Requests |-> IF req[i] \in Held \ {"drained"} THEN out[i] + 1 ELSE out[i]]
       ELSE UNCHANGED requestVars
    /\ UNCHANGED <<obsStatus, obsPause, draining, groupVars, holderVars, restarts>>

MCSpecBroadcastOutside ==
    Init /\ [][SystemNext \/ MCEnvironmentNext \/ \E r \in Ranks : BroadcastFailsOutsideTheHandler(r)]_vars
         /\ Fairness

\* Holder-to-rank maps (a .cfg cannot write a function).
OneHolderOnRankOne == [h \in {1} |-> 1]
OneRankTwoHolders == [h \in {1, 2} |-> 1]
TwoRanksOneHolderEach == [h \in {1, 2} |-> h]
ThreeRanksOneHolderEach == [h \in {1, 2, 3} |-> h]
OneRankThreeHolders == [h \in {1, 2, 3} |-> 1]
\* Two ranks, one holder on rank 1 and two on rank 2.
TwoRanksOneAndTwoHolders == [h \in {1, 2, 3} |-> IF h = 1 THEN 1 ELSE 2]
\* Three ranks, holders 1+1+2 (the audit's liveness model, issue 40, point 5).
ThreeRanksOneOneTwoHolders == [h \in {1, 2, 3, 4} |-> IF h = 4 THEN 3 ELSE h]
\* Two ranks, two holders each (liveness: no symmetry, so numbers, not MCPauseProtocol2x2's model values).
TwoRanksTwoHoldersEachNumbered == [h \in {1, 2, 3, 4} |-> IF h <= 2 THEN 1 ELSE 2]

-----------------------------------------------------------------------------
(* Witnesses: properties that must FAIL, to show the models are not       *)
(* vacuous (as tlaplus/Examples keeps models that fail on purpose).  A     *)
(* model M's run observes each witness of its `witnesses` in models.toml   *)
(* (cbpause.tlc.witnesses: an always-true constraint notes the first state *)
(* or step that breaks it); Witness_NeverX_M checks NeverXWitness alone on *)
(* M's constants, for its counterexample.  A witness of an action is       *)
(* written NeverXWitness == [][~XStep]_vars, XStep the step it must see.   *)

\* A holder does get inside a pause.
NeverInsideWitness == ~AnyInside

\* A paused loop does resume.
ResumesStep == \E r \in Ranks : phase[r] = "window" /\ phase'[r] \notin {"window", "dead"}
NeverResumesWitness == [][~ResumesStep]_vars

\* A dead holder is released while its loop drains (issue 26, point 4).
ReleasedInDrainStep == \E h \in Holders : draining[RankOf[h]] /\ ReleaseDeadHolder(h)
NeverReleasedInDrainWitness == [][~ReleasedInDrainStep]_vars

\* A stop does complete, cleanly (not through a fatal error).
NeverStopsWitness == \A r \in Ranks : ~(phase[r] = "stopped" /\ ~fatal[r])

\* A drain does find work in the batch, and steps it before its window.
NeverDrainsWitness == \A r \in Ranks : ~draining[r]

\* A drain does hold a new request waiting in the scheduler while it steps
\* the batch (Admits; two requests needed).
NeverHeldWitness == ~\E i \in Requests : req[i] = "waiting" /\ ~Admits

\* A holder does wait while a window in a weaker mode than its own is open
\* (it waits for the next window, R-MODES).
NeverDeferredWitness ==
    ~\E h \in Holders : hs[h] = "waiting" /\ paused[RankOf[h]] /\ hmode[h] > tpPause

\* An ABORT window does end a request before its holder is inside.
NeverAbortsWitness ==
    ~(tpPause = ABORT /\ AnyInside /\ \E i \in Requests : out[i] = 1 /\ restarts = 0)

\* A request is delivered, with no fatal error anywhere and no restart (which
\* would clear an error).
NeverDeliveredWitness ==
    \A i \in Requests : ~(req[i] = "delivered" /\ restarts = 0 /\ \A r \in Ranks : ~fatal[r])

\* Holders of every rank are inside one window at once (two ranks: both; three
\* ranks: the third too).
NeverAllRanksInsideWitness ==
    ~\A r \in Ranks : \E h \in HoldersOf(r) : hs[h] = "inside" /\ phase[r] = "window"

\* A window does close to newcomers: a holder left it while another remained
\* (R-WINDOW-CLOSES).
NeverClosingWitness == \A r \in Ranks : ~closing[r]

\* A holder does ask at a closing window, and is queued (QueuePause).
NeverQueuedWitness == \A h \in Holders : hs[h] # "queued"

\* A queued holder does get in: it waits once the window closed, and enters
\* the next one.
QueuedEntersStep == \E h \in Holders : hs[h] = "queued" /\ hs'[h] = "waiting"
NeverQueuedEntersWitness == [][~QueuedEntersStep]_vars

\* A stronger mode is granted with a weaker holder in the same window: the
\* keep holder came to the window the stronger one got (it did not keep it).
NeverStrongerGrantedWitness ==
    ~\E h, k \in Holders :
        /\ hs[h] = "inside" /\ hmode[h] > KEEP
        /\ hs[k] = "inside" /\ hmode[k] = KEEP

\* A request is delivered while holders keep pausing (one waits or is inside),
\* with no fatal error and no restart.
NeverDeliveredWhilePausingWitness ==
    ~\E i \in Requests :
        /\ req[i] = "delivered" /\ restarts = 0 /\ \A r \in Ranks : ~fatal[r]
        /\ \E h \in Holders : hs[h] \in {"waiting", "inside"}
=============================================================================
