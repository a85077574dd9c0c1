------------------------- MODULE MCPauseProtocolInd -------------------------
(***************************************************************************)
(* IndInv: an inductive invariant of PauseProtocol that implies the safety *)
(* properties ExclusionInv, SameWindowInv, CountsInv and NothingLostInv.   *)
(* TLC checks it from every state of a bounded type that satisfies it      *)
(* (IndInit, which is IndTypeOK /\ IndInv), under MCSpec's next-state      *)
(* relation, with IndInv and the four properties as invariants: so safety  *)
(* holds in every state of those bounds that satisfies IndInv, not only in *)
(* the states TLC reaches from Init; and Init satisfies IndInv.            *)
(*                                                                         *)
(* The check is one step (IndStep, a CONSTRAINT: TLC expands the initial  *)
(* states only, and checks the invariants on every successor): IndInv and  *)
(* the properties hold after every step from every state of the bounds     *)
(* that satisfies IndInv, which is what inductive means; exploring the     *)
(* reachable closure adds nothing.                                         *)
(*                                                                         *)
(* IndInit is IndTypeOK /\ IndInv with the conjuncts interleaved, each    *)
(* variable followed at once by the conjuncts that constrain it, so that   *)
(* TLC prunes while it enumerates (count is written as CountsInv's         *)
(* equation, which IndTypeOK's bound then holds by construction).  TLC     *)
(* checks IndInv, an invariant of the cfg, on every initial state too.     *)
(* Two variables start from one value only, because their other values    *)
(* change nothing: the start states stand for every state of the bounds.   *)
(* restarts starts at 0: it is a history variable that no action reads but *)
(* the wrapper's budget on Restart, and no invariant mentions it, so a     *)
(* state with restarts = 0 has every successor of the same state with      *)
(* restarts = 1 (and Restart too).  obsPause[r] starts 0 outside           *)
(* reduce and decided: only SkipWindow and ParkForPeer read it, at         *)
(* decided, and Observe or RecordFatalError write it before a rank gets    *)
(* from any other phase to decided (Restart resets it), and no invariant   *)
(* mentions it; so its value there does not change what can happen.        *)
(* Every mode, the drain flag, the closing flag and dead holders start in  *)
(* every value IndInv allows (issue 25: IndInv was inductive for KEEP      *)
(* only).                                                                  *)
(* docs/tlc.md gives the argument why these bounds suffice.               *)
(***************************************************************************)
EXTENDS MCPauseProtocol

PausePhases == {"decided", "window", "peer", "barrier"}
Ended == {"stopped", "dead"}

\* TypeOK, with the counts, the outputs and the history bounded.
IndTypeOK ==
    /\ LoopTypeOK
    /\ GroupTypeOK
    /\ hs \in [Holders -> HolderStates]
    /\ hmode \in [Holders -> 0..ABORT]
    /\ count \in [Ranks -> 0..Cardinality(Holders)]
    /\ paused \in [Ranks -> BOOLEAN]
    /\ closing \in [Ranks -> BOOLEAN]
    /\ req \in [Requests -> RequestStates]
    /\ out \in [Requests -> 0..1]
    /\ restarts \in 0..MaxRestarts

\* A loop's own variables agree with its phase.
LoopInv(r) ==
    /\ (localStatus[r] = STOPPED) <=> (phase[r] = "stopped")
    /\ obsStatus[r] # DONT_STOP => phase[r] \in {"reduce"} \cup Ended /\ obsStatus[r] <= localStatus[r]
    /\ fatal[r] => phase[r] \in {"reduce", "decided"} \cup Ended /\ localStatus[r] >= HARD_STOP
    /\ (fatal[r] /\ phase[r] = "reduce") => obsStatus[r] = HARD_STOP
    /\ (fatal[r] /\ phase[r] = "decided") => tpStatus = HARD_STOP

\* The group decided a pause that has not passed its barrier: a pause phase
\* (a drain that found work steps its batch first: not a pause phase yet).
InPause(r) ==
    \/ phase[r] \in {"window", "peer", "barrier"}
    \/ phase[r] = "decided" /\ tpPause > 0 /\ tpStatus < HARD_STOP /\ ~draining[r]

\* A drain that found work: every rank agreed it at the same all-reduce (the
\* batches are copies), and until the next one no rank is in a pause phase.
DrainInv ==
    /\ \A r, q \in Ranks : draining[r] = draining[q]
    /\ \A r \in Ranks : draining[r] =>
          /\ tpPause = DRAIN
          /\ \A q \in Ranks : phase[q] \in {"read", "reduce", "decided", "body", "step"} \cup Ended

\* In a DRAIN or ABORT pause no request is in flight from the decision to the
\* barrier (R-MODES): the drain decided on an empty batch, or the abort ended
\* every request the driver held; no step runs until the barrier.
ModeWindowInv ==
    (tpPause \in {DRAIN, ABORT} /\ \E r \in Ranks : InPause(r)) => ~InFlight

\* The group's decision, and the lock-step it imposes: until the barrier, no
\* rank of a pausing group has gone past its pause phases; after a hard stop
\* is agreed, every rank exits.
GroupInv ==
    /\ \A r \in Ranks : localStatus[r] >= tpStatus
    /\ (\E r \in Ranks : InPause(r)) =>
          /\ tpPause > 0 /\ tpStatus < HARD_STOP
          /\ \A q \in Ranks : phase[q] \in PausePhases \cup Ended
    /\ tpStatus = HARD_STOP => \A q \in Ranks : phase[q] \in {"decided"} \cup Ended

\* A window is open only while its loop is parked in it, and a holder is
\* inside only while its window is open.
WindowInv ==
    /\ \A r \in Ranks : paused[r] => phase[r] \in {"window", "dead"}
    /\ \A h \in Holders : hs[h] = "inside" => paused[RankOf[h]]

IndInv ==
    /\ \A r \in Ranks : LoopInv(r)
    /\ GroupInv
    /\ DrainInv
    /\ CountsInv
    /\ WindowInv
    /\ ModeInv
    /\ ModeWindowInv
    /\ NothingLostInv

IndInit ==
    /\ phase \in [Ranks -> Phases]
    /\ localStatus \in [Ranks -> StopStatuses]
    /\ \A r \in Ranks : (localStatus[r] = STOPPED) <=> (phase[r] = "stopped")
    /\ tpStatus \in StopStatuses
    /\ tpPause \in {0} \cup Modes
    /\ draining \in [Ranks -> BOOLEAN]
    /\ GroupInv
    /\ DrainInv
    /\ obsStatus \in [Ranks -> StopStatuses]
    /\ fatal \in [Ranks -> BOOLEAN]
    /\ \A r \in Ranks : LoopInv(r)
    /\ obsPause \in [Ranks -> {0} \cup Modes]
    /\ \A r \in Ranks : obsPause[r] > 0 => phase[r] \in {"reduce", "decided"}
    /\ hs \in [Holders -> HolderStates]
    /\ hmode \in [Holders -> {0} \cup Modes]
    /\ \A h \in Holders : (hmode[h] = 0) <=> (hs[h] = "idle")
    /\ count = [r \in Ranks |-> Cardinality({h \in HoldersOf(r) : Counted(h)})]
    /\ paused \in [Ranks -> BOOLEAN]
    /\ closing \in [Ranks -> BOOLEAN]
    /\ WindowInv
    /\ CountsInv
    /\ req \in [Requests -> RequestStates]
    /\ out \in [Requests -> 0..1]
    /\ ModeInv
    /\ ModeWindowInv
    /\ NothingLostInv
    /\ restarts = 0

IndNext == SystemNext \/ MCEnvironmentNext

\* One step from the initial states: the check of induction.
IndStep == TLCGet("level") < 2
=============================================================================
