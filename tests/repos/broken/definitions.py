"""Each feature set has one problem freshline plan must name, with this file's line."""

from freshline import Entity, FeatureSet, Field, Table

member = Entity("member", key="member_id", type="uuid")
loans = Table("lib_loans", entities={member: "member_id"})
ghosts = Table("lib_ghosts", entities={member: "member_id"})
wrong_column = Table("lib_books", entities={member: "owner_id"})

swapped = FeatureSet(  # the fields come back in another order
    "swapped",
    entity=member,
    ttl="1m",
    sources=(loans,),
    fields=(Field("b", "int"), Field("a", "int")),
    query="SELECT k.member_id, 1 AS a, 2 AS b FROM keys k",
)
mistyped = FeatureSet(  # a text column declared an int
    "mistyped",
    entity=member,
    ttl="1m",
    sources=(loans,),
    fields=(Field("title", "int"),),
    query="SELECT k.member_id, 'x'::text AS title FROM keys k",
)
unknown_table = FeatureSet(
    "unknown_table",
    entity=member,
    ttl="1m",
    sources=(ghosts,),
    fields=(Field("n", "int"),),
    query="SELECT k.member_id, 1 AS n FROM keys k",
)
unknown_column = FeatureSet(
    "unknown_column",
    entity=member,
    ttl="1m",
    sources=(wrong_column,),
    fields=(Field("n", "int"),),
    query="SELECT k.member_id, 1 AS n FROM keys k",
)
# Reads the moment it is computed for, with no horizon: stale once a loan leaves the window.
borrower = Entity("borrower", key="member_id", type="uuid", table="lib_members")
borrowed = Table("lib_loans", entities={borrower: "member_id"})
windowed = FeatureSet(
    "windowed",
    entity=borrower,
    ttl="1h",
    sources=(borrowed,),
    fields=(Field("recent", "int"),),
    query="""
SELECT k.member_id, count(l.id) AS recent
FROM keys k CROSS JOIN t
LEFT JOIN lib_loans l ON l.member_id = k.member_id
                     AND l.loaned_at > t.as_of - interval '30 days' AND l.loaned_at <= t.as_of
GROUP BY k.member_id
""",
)
misspelt_horizon = FeatureSet(  # the horizon names a column the query does not return
    "misspelt_horizon",
    entity=member,
    ttl="1h",
    sources=(loans,),
    fields=(Field("n", "int"),),
    query="SELECT k.member_id, 1 AS n FROM keys k",
    horizon="(SELECT max(l.loaned_at) + interval '30 days' FROM lib_loans l "
    "WHERE l.member_id = f.membr_id)",
)
