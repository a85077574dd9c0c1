------------------------ MODULE MCPauseProtocolEntry ------------------------
(***************************************************************************)
(* Bounded pause entry (R-BOUNDED-ENTRY), checked over a ghost counter.    *)
(* entrySteps[h][q] counts the forward steps rank q starts while holder h  *)
(* waits: from its RequestPause to its EnterPause, or to the PauseFails,   *)
(* Interrupt or PauseTimeout that ends its wait.  The ghost only watches:  *)
(* EntryNext is MCSpec's next-state relation with the counter's update     *)
(* conjoined, so the behaviours are MCSpec's.  Safety only: no fairness.   *)
(*                                                                         *)
(* The bound: the holder's own rank starts at most one forward step (the   *)
(* one of the iteration whose observation came before the request; the     *)
(* next observation sees the request, and the group pauses).  A peer rank  *)
(* may start two: the all-reduce lets a peer lag one iteration behind, so  *)
(* it may still have its step of the previous iteration to run.  The      *)
(* counter saturates at 3, which is past both bounds.                      *)
(***************************************************************************)
EXTENDS MCPauseProtocol

VARIABLE entrySteps   \* [Holders -> [Ranks -> 0..3]]; all 0 while a holder does not wait

entryVars == <<vars, entrySteps>>

NoEntrySteps == [r \in Ranks |-> 0]

EntryInit == Init /\ entrySteps = [h \in Holders |-> NoEntrySteps]

\* A rank that starts a forward step counts it for every holder still
\* waiting after the step; a holder that does not wait has no count.
EntryGhost ==
    entrySteps' =
        [h \in Holders |->
            IF hs'[h] # "waiting" THEN NoEntrySteps
            ELSE [q \in Ranks |->
                    IF phase[q] = "body" /\ phase'[q] = "step"
                    THEN IF entrySteps[h][q] < 3 THEN entrySteps[h][q] + 1 ELSE 3
                    ELSE entrySteps[h][q]]]

EntryNext == (SystemNext \/ MCEnvironmentNext) /\ EntryGhost

EntrySpec == EntryInit /\ [][EntryNext]_entryVars

EntryTypeOK == entrySteps \in [Holders -> [Ranks -> 0..3]]

\* R-BOUNDED-ENTRY.
BoundedEntryInv ==
    \A h \in Holders : \A q \in Ranks :
        entrySteps[h][q] <= (IF q = RankOf[h] THEN 1 ELSE 2)

\* Witnesses (must fail): a rank does step while a holder waits, and a peer
\* rank does step twice (the exception is needed).
NeverStepsWhileWaitingWitness == \A h \in Holders : entrySteps[h] = NoEntrySteps
NeverTwoPeerStepsWitness == \A h \in Holders : \A q \in Ranks : entrySteps[h][q] <= 1
=============================================================================
