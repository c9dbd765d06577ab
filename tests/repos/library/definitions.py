"""A lending library: members (uuid keys, no tenant column), loans, books."""

from freshline import Entity, FeatureSet, Field, Table

member = Entity(
    "member",
    key="member_id",
    type="uuid",
    table="lib_members",
    active="NOT coalesce(e.suspended, false)",  # warmed before a deploy flips
)

members = Table("lib_members", entities={member: "member_id"})
loans = Table("lib_loans", entities={member: "member_id"})
# A book marked lost changes the features of every member who has borrowed it.
books = Table(
    "lib_books",
    reverse={member: "SELECT DISTINCT member_id FROM lib_loans WHERE book_id = :book_id"},
)

loans_now = FeatureSet(
    "loans_now",
    entity=member,
    ttl="10m",
    sources=(members, loans, books),
    fields=(
        Field("open_loans", "int"),
        Field("lost_books", "int"),
        Field("last_loan_at", "timestamp"),
    ),
    query="""
SELECT k.member_id,
       count(l.id) FILTER (WHERE l.returned_at IS NULL) AS open_loans,
       count(l.id) FILTER (WHERE b.lost) AS lost_books,
       max(l.loaned_at) AS last_loan_at
FROM keys k CROSS JOIN t
LEFT JOIN lib_loans l ON l.member_id = k.member_id AND l.loaned_at <= t.as_of
LEFT JOIN lib_books b ON b.book_id = l.book_id
GROUP BY k.member_id
""",
)

standing = FeatureSet(
    "standing",
    entity=member,
    ttl=600,
    mode="invalidate",
    sources=(members,),
    fields=(Field("name", "str"), Field("suspended", "bool")),
    query="""
SELECT k.member_id, m.name, coalesce(m.suspended, false) AS suspended
FROM keys k LEFT JOIN lib_members m ON m.member_id = k.member_id
""",
)
