------------------------- MODULE MCPauseProtocol2x2 -------------------------
(* Two ranks, two holders each.  The holders are model values, so that TLC *)
(* can use the symmetry of holders of the same rank; symmetry is unsound   *)
(* with liveness, so models of this module check safety only.             *)
EXTENDS MCPauseProtocol

CONSTANTS h1, h2, h3, h4

TwoRanksTwoHoldersEach == (h1 :> 1) @@ (h2 :> 1) @@ (h3 :> 2) @@ (h4 :> 2)
HolderPerms == Permutations({h1, h2}) \cup Permutations({h3, h4})
=============================================================================
