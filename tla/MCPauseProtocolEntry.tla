------------------------ MODULE MCPauseProtocolEntry ------------------------
(***************************************************************************)
(* Bounded pause entry (R-BOUNDED-ENTRY), checked over a ghost counter.    *)
(* entrySteps[h][q] counts the forward steps rank q starts while holder h  *)
(* waits: from its RequestPause (or QueuePause: a holder queued at a       *)
(* closing window waits there too) to its EnterPause, or to the            *)
(* PauseFails, Interrupt, PauseTimeout or LeaveQueue that ends its wait:   *)
(* the bound is "the rest of the window plus one forward step", and the    *)
(* rest of a window has no step.  The ghost only watches:                  *)
(* EntryNext is MCSpec's next-state relation with the counter's update     *)
(* conjoined, so the behaviours are MCSpec's.  Safety only: no fairness.   *)
(*                                                                         *)
(* The bound, per mode (R-BOUNDED-ENTRY): the holder's own rank starts at  *)
(* most one forward step (the one of the iteration whose observation came  *)
(* before the request; the next observation sees the request, and the      *)
(* group pauses: in KEEP, in RETRACT (the KV freed at the decision) and in *)
(* ABORT (the batch ended at the decision), without a step), plus, if the  *)
(* group agreed a DRAIN while the holder waited (its own, or a stronger   *)
(* holder's that it waits for), the steps the batch needs to finish: the   *)
(* drain admits nothing and opens its window once the batch is empty;      *)
(* that is two in the model (a request ends at its second step).  A peer   *)
(* rank may start one step more: the all-reduce lets a peer lag one        *)
(* iteration behind, so it may still have its step of the previous         *)
(* iteration to run.  sawDrain[h] records whether a drain was agreed       *)
(* during h's wait.  The counter saturates at 5, past every bound.         *)
(***************************************************************************)
EXTENDS MCPauseProtocol

VARIABLES
    entrySteps,   \* [Holders -> [Ranks -> 0..5]]; all 0 while a holder does not wait
    sawDrain      \* [Holders -> BOOLEAN]: a drain was agreed while the holder waited

entryVars == <<vars, entrySteps, sawDrain>>

NoEntrySteps == [r \in Ranks |-> 0]

EntryInit ==
    /\ Init
    /\ entrySteps = [h \in Holders |-> NoEntrySteps]
    /\ sawDrain = [h \in Holders |-> FALSE]

\* A rank that starts a forward step counts it for every holder still
\* waiting after the step; a holder that does not wait has no count.
EntryGhost ==
    entrySteps' =
        [h \in Holders |->
            IF hs'[h] \notin {"queued", "waiting"} THEN NoEntrySteps
            ELSE [q \in Ranks |->
                    IF phase[q] = "body" /\ phase'[q] = "step"
                    THEN IF entrySteps[h][q] < 5 THEN entrySteps[h][q] + 1 ELSE 5
                    ELSE entrySteps[h][q]]]

DrainGhost ==
    sawDrain' = [h \in Holders |-> hs'[h] \in {"queued", "waiting"} /\ (sawDrain[h] \/ \E q \in Ranks : draining'[q])]

EntryNext == (SystemNext \/ MCEnvironmentNext) /\ EntryGhost /\ DrainGhost

EntrySpec == EntryInit /\ [][EntryNext]_entryVars

EntryTypeOK == entrySteps \in [Holders -> [Ranks -> 0..5]] /\ sawDrain \in [Holders -> BOOLEAN]

\* The forward steps a batch needs to finish, at most: two per request in
\* the model (P-END-STEP), run together in one batch.  (Since a drain holds
\* admission, Admits, a request in flight at the drain's decision has had its
\* first step, and the drain needs one: the bound has a step of slack, which
\* NeverDrainsTheBatchWitness shows; issue 40.)
BatchSteps == 2

\* R-BOUNDED-ENTRY, per mode: what the holder's own rank may start while h waits.
OwnEntrySteps(h) == 1 + (IF sawDrain[h] THEN BatchSteps ELSE 0)

BoundedEntryInv ==
    \A h \in Holders : \A q \in Ranks :
        entrySteps[h][q] <= OwnEntrySteps(h) + (IF q = RankOf[h] THEN 0 ELSE 1)

\* Witnesses (must fail): a rank does step while a holder waits, and a peer
\* rank does step twice (the exception is needed).
NeverStepsWhileWaitingWitness == \A h \in Holders : entrySteps[h] = NoEntrySteps
NeverTwoPeerStepsWitness == \A h \in Holders : \A q \in Ranks : entrySteps[h][q] <= 1
\* A drain does step the batch: its rank starts a step beyond the one a
\* holder's rank may start in any mode.
NeverDrainsTheBatchWitness ==
    \A h \in Holders : sawDrain[h] => entrySteps[h][RankOf[h]] < 2

=============================================================================
